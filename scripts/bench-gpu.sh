#!/usr/bin/env bash
# The benchmarks that need a GPU, at full size with random weights (speed does not depend on the weights'
# values). Usage: scripts/bench-gpu.sh OUTDIR [engine|capacity|batch1|compiled-int8|batch1-autotune|weights|weights-autotune|kv|node|oracle|media|all]
# Needs the package importable (an installed venv, or PYTHONPATH=repo root) and a CUDA GPU with ~80 GB.
# Each part writes OUTDIR/<part>.txt (what it printed) and OUTDIR/<part>.json (the figures). Each part but
# `all` ends within 580 s (its commands' timeouts), so one part fits one call of the device tool (600 s), and
# writes at most 8 files (what one call brings back). The callers' voices: VOICES (scripts/gpu-carry.sh).
set -uo pipefail
out=${1:?usage: scripts/bench-gpu.sh OUTDIR [engine|capacity|batch1|compiled-int8|batch1-autotune|weights|weights-autotune|kv|node|oracle|media|all]}
what=${2:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

if [[ $what == engine || $what == all ]]; then
  # context 2000 frames (160 s) is what lets 48 calls' KV caches fit 80 GB (docs/benchmarks.md).
  timeout 540 "$py" -m kame_phone.cli bench engine --size moshi-7b --batch 1,8,16,32,48,64 --context 2000 \
    --json "$out/engine.json" 2>&1 | tee "$out/engine.txt"
fi
if [[ $what == capacity || $what == all ]]; then
  # Calls per GPU at the full 4-minute context (issue 15): 8-bit KV caches against the model's bf16.
  for kv in int8 fp8 auto; do
    case $kv in int8) batches=1,48,64,72 ;; fp8) batches=1,64 ;; auto) batches=1,32,48 ;; esac
    case $kv in int8) t=220 ;; fp8) t=160 ;; auto) t=180 ;; esac
    timeout "$t" "$py" -m kame_phone.cli bench engine --size moshi-7b --batch "$batches" --context 3000 \
      --kv-dtype "$kv" --json "$out/capacity-$kv.json" 2>&1 | tee "$out/capacity-$kv.txt"
  done
fi
if [[ $what == weights || $what == all ]]; then
  # 8-bit weights (engine/weight_quant.py): ~7.4 GB freed for KV caches (calls past 64 on an H100 with the
  # int8 cache). Eager, the int8 matmul dequantizes each weight every step (slower than bf16: the figure says
  # by how much); compiled with max-autotune, inductor can fuse that into its matmul (batch 1, with phases).
  # torch's own CUDA int8 kernel is a reference kernel, not measured.
  timeout 300 "$py" -m kame_phone.cli bench engine --size moshi-7b --batch 1,64,80 --context 3000 --kv-dtype int8 \
    --weights-dtype int8 --json "$out/weights.json" 2>&1 | tee "$out/weights.txt"
fi
if [[ $what == weights-autotune || $what == all ]]; then
  timeout 570 "$py" -m kame_phone.cli bench engine --size moshi-7b --batch 1 --context 3000 --ticks 300 \
    --weights-dtype int8 --compile max-autotune --phases --json "$out/batch1-int8w-autotune.json" 2>&1 \
    | tee "$out/batch1-int8w-autotune.txt"
fi
if [[ $what == batch1 || $what == all ]]; then
  # Batch-1 latency (issue 15): the official step against --compile (engine/compiled_step.py), phase by
  # phase, at the 4-minute context (the official step loads and runs in ~2 min; compiling takes the rest).
  for c in off default; do
    case $c in off) t=140 ;; default) t=430 ;; esac
    timeout "$t" "$py" -m kame_phone.cli bench engine --size moshi-7b --batch 1 --context 3000 --ticks 300 \
      --compile "$c" --phases --json "$out/batch1-$c.json" 2>&1 | tee "$out/batch1-$c.txt"
  done
fi
if [[ $what == compiled-int8 || $what == all ]]; then
  # The compiled tick with the 8-bit cache, at 1 and 64 calls.
  timeout 540 "$py" -m kame_phone.cli bench engine --size moshi-7b --batch 1,64 --context 3000 --kv-dtype int8 \
    --compile default --phases --json "$out/compiled-int8.json" 2>&1 | tee "$out/compiled-int8.txt"
fi
if [[ $what == batch1-autotune ]]; then
  # Inductor's autotuned kernels (minutes of warm-up): only worth a deployment's start-up if it beats default.
  timeout 570 "$py" -m kame_phone.cli bench engine --size moshi-7b --batch 1 --context 3000 --ticks 300 \
    --compile max-autotune --phases --json "$out/batch1-max-autotune.json" 2>&1 | tee "$out/batch1-max-autotune.txt"
fi
if [[ $what == kv || $what == all ]]; then
  # What the 8-bit caches cost in accuracy at full size: 500 greedy steps against the bf16 cache.
  timeout 300 "$py" -m kame_phone.cli bench kv --size moshi-7b --context 3000 --steps 500 \
    --json "$out/kv.json" 2>&1 | tee "$out/kv.txt"
fi
if [[ $what == node || $what == all ]]; then
  # The whole node (issue 15) with no weights on the box: KAME random at full size, the STT in Kyutai's
  # 2.6B layout with random weights on the same GPU, a local LLM stand-in; the callers' voices come from
  # VOICES, default var/voices (made beforehand where flite is: scripts/gpu-carry.sh). With bf16
  # weights, 64 calls and the STT need more than an 80 GB H100 holds at context 3000 (docs/benchmarks.md):
  # WEIGHTS=int8 (the default here) frees ~7.4 GB for them.
  for calls in 48 64; do
    KAME_STT_CHECKPOINT=random:stt-2.6b-en timeout 280 "$py" -m kame_phone.cli bench node --calls "$calls" \
      --checkpoint random:moshi-7b --voices "${VOICES:-var/voices}" --serve-arg=--stt=kyutai \
      --serve-arg=--kv-dtype=int8 --serve-arg=--weights-dtype="${WEIGHTS:-int8}" --serve-arg=--context=3000 \
      --json "$out/node-$calls.json" 2>&1 | tee "$out/node-$calls.txt"
  done
fi
if [[ $what == oracle || $what == all ]]; then
  # 32 calls, the engine in its own process as served: a fixed TTFT (the target's setting), then varying.
  for jitter in 0 100; do
    timeout 200 "$py" -m kame_phone.cli bench oracle --size moshi-7b --calls 32 --seconds 20 --context 2000 \
      --engine-process --llm-ttft-jitter-ms "$jitter" --json "$out/oracle-$jitter.json" 2>&1 | tee "$out/oracle-$jitter.txt"
  done
fi
if [[ $what == media || $what == all ]]; then
  # The phone edge alone (no model), 200 calls: one edge process, then two and four on one engine link.
  for edges in 1 2 4; do
    timeout 120 "$py" -m kame_phone.cli bench media --calls 200 --seconds 20 --edges "$edges" \
      $([[ $edges == 1 ]] || echo --engine-link) --json "$out/media-$edges.json" 2>&1 | tee "$out/media-$edges.txt"
  done
fi
