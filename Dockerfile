# syntax=docker/dockerfile:1
#
# KAME Phone: the production image (`kame-phone serve` on one NVIDIA GPU).
#
#   docker build -t kame-phone .
#   docker run --gpus 1 -p 8080:8080 --env-file ops/.env -e REDIS_URL=redis://<redis-host>:6379/0 \
#     -v kame-hf:/data kame-phone
#   (ops/.env's REDIS_URL, 127.0.0.1, is the container itself inside it: the node would answer, ready, with no
#   call store; or run with --network host, or leave REDIS_URL empty for one node with no records kept)
#   (/metrics is on 9092, unpublished here: add -p 127.0.0.1:9092:9092 to scrape it from the host)
#
# Base image: nvidia/cuda:<ver>-base-ubuntu24.04, on purpose not -cudnn-runtime nor pytorch/pytorch.
#   * PyTorch's CUDA wheels bring their own CUDA runtime, cuBLAS, cuDNN and NCCL as nvidia-* pip packages
#     (found through RPATH). A -cudnn-runtime base would carry a second, unused ~3 GB copy of them.
#   * The -base image still sets NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES, so the NVIDIA
#     container toolkit mounts the host driver (libcuda) into the container.
#   * pytorch/pytorch images fix both the torch version and a conda Python; we want a torch from the
#     supported 2.11-2.13 range, chosen at build time, in a plain Python 3.12 venv.
#   * Ubuntu 24.04's system Python is 3.12: no PPA, no source build.
# Host: NVIDIA driver >= 570 for cu128 wheels (CUDA 12.x minor-version compatibility usually lets
# drivers >= 525 work too). Override TORCH_INDEX_URL / CUDA_BASE together for another CUDA line.
ARG CUDA_BASE=nvidia/cuda:12.8.1-base-ubuntu24.04

# ---------------------------------------------------------------------------------------------------
FROM ${CUDA_BASE} AS build

ARG TORCH_VERSION=2.11.*
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG MOSHI_VERSION=0.2.13

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv /opt/venv \
 && pip install --no-cache-dir --upgrade pip

# 1. torch, CUDA build, alone: the largest layer and the one that changes least.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && pip freeze | grep -i '^torch==' > /opt/torch-pin.txt \
 && python -c "import torch; assert torch.version.cuda, 'got a CPU-only torch'; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# 2. Our runtime dependencies, read from pyproject.toml so this layer is rebuilt only when they change.
#    The torch pin keeps pip from swapping the CUDA build for PyPI's.
COPY pyproject.toml /src/pyproject.toml
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import tomllib; print('\n'.join(tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && pip install -c /opt/torch-pin.txt -r /tmp/requirements.txt

# 3. The service itself, then moshi with --no-deps: moshi 0.2.13 pins torch<2.10 and aiohttp<3.12,
#    which would downgrade both; its real runtime needs are already in pyproject.toml.
#    (Only pyproject.toml, README.md and the package folders reach the context: see .dockerignore.)
COPY . /src
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c /opt/torch-pin.txt /src \
 && pip install --no-deps "moshi==${MOSHI_VERSION}" \
 && python -c "import torch, moshi, engine, knowledge, telephony, kame_phone; assert torch.version.cuda" \
 && kame-phone --help > /dev/null

# ---------------------------------------------------------------------------------------------------
FROM ${CUDA_BASE} AS runtime

# gcc, libc6-dev and python3.12-dev are runtime needs, not leftovers: moshi wraps its rope/gating/
# transformer kernels in torch.compile, and Triton builds its CUDA launcher with a C compiler and
# Python.h on first use. Without them the first call fails with "Failed to find C compiler".
# (Setting NO_TORCH_COMPILE=1 avoids the need at the cost of slower engine ticks.)
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3.12 ca-certificates gcc libc6-dev python3.12-dev \
 && rm -rf /var/lib/apt/lists/*

# Non-root user with a fixed uid (k8s runAsUser/fsGroup use 10001). /data is the cache volume:
# Hugging Face weights (~16 GB) plus the TorchInductor/Triton compile caches, so restarts skip both.
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/kame --shell /usr/sbin/nologin kame \
 && mkdir -p /data/huggingface /data/torchinductor /data/triton \
 && chown -R kame:kame /data

COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KAME_LOG_JSON=1 \
    HF_HOME=/data/huggingface \
    HF_HUB_DISABLE_TELEMETRY=1 \
    TORCHINDUCTOR_CACHE_DIR=/data/torchinductor \
    TRITON_CACHE_DIR=/data/triton

VOLUME ["/data"]
USER kame
WORKDIR /home/kame
# 8080: the public listener (Twilio's webhooks and media streams). 9092: /metrics, for Prometheus only.
EXPOSE 8080 9092

# On SIGTERM the service stops taking calls, lets running calls finish (minutes), then exits: give it
# time (compose stop_grace_period / k8s terminationGracePeriodSeconds), never SIGKILL early.
STOPSIGNAL SIGTERM

# Liveness only (/healthz). Readiness (/readyz: model loaded, not draining; Redis reported) is for load
# balancers. The long start period covers a first start that downloads the weights. No curl in the
# image: Python does the request. Assumes the default port 8080.
# KAME_HEALTH_PORT: 8080 for `serve`; set it to engine-serve's --http-port (9091) for an engine container.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30m --retries=4 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KAME_HEALTH_PORT', '8080'), timeout=4)"]

ENTRYPOINT ["kame-phone"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080", "--metrics-host", "0.0.0.0", "--metrics-port", "9092", "--stt", "kyutai"]
