#!/usr/bin/env bash
# What a device call (the lent GPU box: Python 3.12, torch 2.11, no internet, no flite) needs beside the
# working tree, made here (after scripts/setup.sh), both git-ignored:
# - .whl/: the Python packages the box lacks, as cp312 wheels at the versions this checkout's .venv runs, so
#   the GPU figures come from the code the tests ran;
# - var/voices/: the callers' flite questions for `scripts/bench-gpu.sh OUT node` (its default VOICES).
# Then name both in the call's carry and begin its command with (docs/benchmarks.md, "Owed"):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD || exit; scripts/bench-gpu.sh "$OUT" batch1
# The box has torch, numpy, aiohttp, scipy, safetensors, sentencepiece, prometheus-client, requests, httpx's
# own needs and the rest of what these name; it has huggingface-hub 1.x, and moshi was tested with 0.36.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=.venv/bin/pip
[[ -x $pip ]] || { echo "gpu-carry: run ./scripts/setup.sh first (the versions come from .venv)" >&2; exit 1; }

# What serve, engine-serve and the benches import, with what those need beyond the box's image. Not
# pocketsphinx (no cp312 wheel of our version here): the GPU runs use --stt kyutai, and serve imports
# pocketsphinx only for --stt pocketsphinx.
names=(moshi sphn einops huggingface_hub hf-xet twilio PyJWT aiohttp-retry redis openai httpx2 httpcore2 truststore
       pydantic pydantic_core annotated-types typing-inspection jiter sniffio soxr python-dotenv threadpoolctl)
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
.venv/bin/python -c "from pathlib import Path; from kame_phone.node_bench import caller_voices
print(len(caller_voices(Path('var/voices'))), 'voices')" | sed 's/^/gpu-carry: /'
du -sh .whl var/voices | sed 's/^/gpu-carry: /'
echo 'gpu-carry: carry [".whl", "var/voices"] (64 MiB at most with the tree)'
