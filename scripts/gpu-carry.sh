#!/usr/bin/env bash
# What a device call (the lent GPU box: Python 3.12, torch 2.11, no internet, no flite) needs beside the
# working tree, made here (after scripts/setup.sh), both git-ignored:
# - .whl/: the Python packages the box lacks, as cp312 wheels at the versions this checkout's .venv runs, so
#   the GPU figures come from the code the tests ran;
# - var/voices/: the callers' flite questions for `scripts/bench-gpu.sh OUT node` (its default VOICES).
# Then name both in the call's carry and begin its command with (docs/benchmarks.md, "Owed"):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD || exit; scripts/bench-gpu.sh "$OUT" batch1
# The box has torch, numpy, aiohttp, scipy, safetensors, sentencepiece, prometheus-client, requests and the
# rest of what these name; it has huggingface-hub 1.x, and moshi was tested with 0.36. Its versions of
# typing-extensions, anyio, idna and h11 are not known, and what we carry needs recent ones (pydantic-core
# typing-extensions >= 4.16, openai and httpx2 anyio >= 4.10, httpx2 idna >= 3.18, httpcore2 h11 >= 0.16),
# and every part imports openai and pydantic to build the CLI's parser: those are carried too. At the end,
# each carried wheel's Requires-Dist is checked: a carried one must satisfy it (else this fails); what is
# left to the box is listed.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=.venv/bin/pip
[[ -x $pip ]] || { echo "gpu-carry: run ./scripts/setup.sh first (the versions come from .venv)" >&2; exit 1; }

# What serve, engine-serve and the benches import, with what those need beyond the box's image. Not
# pocketsphinx (no cp312 wheel of our version here): the GPU runs use --stt kyutai, and serve imports
# pocketsphinx only for --stt pocketsphinx.
names=(moshi sphn einops huggingface_hub hf-xet twilio PyJWT aiohttp-retry redis openai httpx2 httpcore2 truststore
       pydantic pydantic_core annotated-types typing-inspection jiter sniffio soxr python-dotenv threadpoolctl
       typing_extensions anyio idna h11 jsonschema jsonschema-specifications referencing rpds-py attrs)
pins=()
for n in "${names[@]}"; do
  v=$("$pip" show "$n" 2>/dev/null | sed -n 's/^Version: //p')
  [[ -n $v ]] || { echo "gpu-carry: $n is not in .venv" >&2; exit 1; }
  pins+=("$n==$v")
done

rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
"$pip" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  --platform any -d .whl "${pins[@]}"
.venv/bin/python - .whl <<'PY' | sed 's/^/gpu-carry: /'
# Each carried wheel's Requires-Dist (for CPython 3.12 on x86-64 Linux, no extras) against what is carried.
import re, sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "os_name": "posix", "extra": ""}
carried, needs = {}, []
for whl in sorted(Path(sys.argv[1]).glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))).decode()
    name = canonicalize_name(re.search(r"^Name: (.+)$", meta, re.M).group(1).strip())
    carried[name] = re.search(r"^Version: (.+)$", meta, re.M).group(1).strip()
    needs += [(name, Requirement(line)) for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M)]
bad, box = [], {}
for who, req in needs:
    if req.marker is not None and not req.marker.evaluate(env):
        continue
    have = carried.get(canonicalize_name(req.name))
    if have is None:
        box.setdefault(f"{canonicalize_name(req.name)}{req.specifier}", []).append(who)
    elif not req.specifier.contains(have, prereleases=True):
        bad.append(f"{who} needs {req}, carried {have}")
for need, whos in sorted(box.items()):
    print(f"left to the box: {need} (for {', '.join(sorted(set(whos)))})")
for b in bad:
    print(f"NOT MET: {b}")
sys.exit(1 if bad else 0)
PY
.venv/bin/python -c "from pathlib import Path; from kame_phone.node_bench import caller_voices
print(len(caller_voices(Path('var/voices'))), 'voices')" | sed 's/^/gpu-carry: /'
du -sh .whl var/voices | sed 's/^/gpu-carry: /'
echo 'gpu-carry: carry [".whl", "var/voices"] (64 MiB at most with the tree)'
