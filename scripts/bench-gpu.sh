#!/usr/bin/env bash
# The benchmarks that need a GPU, at full size with random weights (speed does not depend on the weights'
# values). Usage: scripts/bench-gpu.sh OUTDIR PART, or scripts/bench-gpu.sh --budget PART (the seconds PART
# can take at most), or scripts/bench-gpu.sh --parts (each part and its budget).
# Needs the package importable (an installed venv, or PYTHONPATH=repo root) and a CUDA GPU with ~80 GB.
# Each command writes OUTDIR/<name>.txt (what it printed) and OUTDIR/<name>.json (the figures; the engine
# bench rewrites it after each batch, so a command cut short keeps its finished batches). Each part but
# `all` ends within its budget (its commands' timeouts, and 5 s more each to end what a command left), at
# most 580 s, so one part fits one call of the device tool (600 s), and writes at most 8 files (what one
# call brings back). docs/benchmarks.md ("Owed") says which parts a 15-minute session runs, in what order.
# The callers' voices: VOICES (scripts/gpu-carry.sh).
set -uo pipefail

# part -> budget in seconds: the sum of its commands' timeouts, and 5 s a command for `reap` (a bench
# dies at timeout's SIGTERM: none traps it; the SIGKILL 10 s later is for one that would not).
declare -A budget=(
  [batch1]=430 [node-48]=275 [node-64]=275 [node-64-stt-thread]=275 [node]=550 [weights]=305 [kv-cache]=285 [kv-weights]=285 [kv]=570
  [compiled-int8]=575 [weights-autotune]=575 [batch1-autotune]=575 [batch1-no-main]=255 [capacity]=575
  [engine]=545 [oracle]=410
  [media]=375 [stt]=315
)
parts="stt batch1 node-48 node-64 node-64-stt-thread node weights kv-cache kv-weights kv compiled-int8 weights-autotune batch1-autotune batch1-no-main capacity engine oracle media"
usage="usage: scripts/bench-gpu.sh OUTDIR PART | --budget PART | --parts (PART: ${parts// /|}|all)"
case ${1:-} in
  --budget) [[ -n ${budget[${2:-}]:-} ]] || { echo "$usage" >&2; exit 2; }; echo "${budget[$2]}"; exit 0 ;;
  --parts) for p in $parts; do echo "$p ${budget[$p]}"; done; exit 0 ;;
esac
out=${1:?$usage}
what=${2:?$usage}
[[ $what == all || -n ${budget[$what]:-} ]] || { echo "$usage" >&2; exit 2; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

# Whatever a command left running: serve and its engine process trap SIGTERM and drain, so after
# `timeout` has ended the bench they can live on, holding GPU memory, into the next command. `timeout`
# leads a process group of its own (its pid) that they share: ended here, the group waited for.
reap() {
  local g=$1 i
  for i in 1 2 3 4 5 6; do
    kill -0 -- "-$g" 2>/dev/null || return 0
    ((i == 1)) && echo "bench-gpu: ending what the command left running (process group $g)" >&2 \
      && kill -TERM -- "-$g" 2>/dev/null
    ((i == 3)) && kill -KILL -- "-$g" 2>/dev/null
    ((i == 6)) && break
    sleep 1
  done
  echo "bench-gpu: process group $g still there 5 s on (zombies?)" >&2
}

# run NAME SECONDS ARGS...: `kame-phone bench ARGS` under `timeout` (SIGTERM at SECONDS, SIGKILL 10 s later
# if it were still there), its output on the screen and in OUTDIR/NAME.txt, then reap.
run() {
  local name=$1 t=$2
  shift 2
  echo "bench-gpu: $name (at most ${t} s) at $(date +%T)"
  {
    timeout -k 10 "$t" "$py" -m kame_phone.cli bench "$@" &
    local pid=$!
    wait "$pid"
    local rc=$?
    reap "$pid"
    ((rc == 124 || rc == 137)) && echo "bench-gpu: $name ran out of its ${t} s"
    exit "$rc"
  } 2>&1 | tee "$out/$name.txt"
}

if [[ $what == engine || $what == all ]]; then
  # context 2000 frames (160 s) is what lets 48 calls' KV caches fit 80 GB (docs/benchmarks.md).
  run engine 540 engine --size moshi-7b --batch 1,8,16,32,48,64 --context 2000 --json "$out/engine.json"
fi
if [[ $what == capacity || $what == all ]]; then
  # Calls per GPU at the full 4-minute context (issue 15): 8-bit KV caches against the model's bf16.
  for kv in int8 fp8 auto; do
    case $kv in int8) batches=1,48,64,72 ;; fp8) batches=1,64 ;; auto) batches=1,32,48 ;; esac
    case $kv in int8) t=220 ;; fp8) t=160 ;; auto) t=180 ;; esac
    run "capacity-$kv" "$t" engine --size moshi-7b --batch "$batches" --context 3000 --kv-dtype "$kv" \
      --json "$out/capacity-$kv.json"
  done
fi
if [[ $what == stt || $what == all ]]; then
  # Kyutai STT's step in its 2.6B layout (random weights), alone and beside a busy Python thread (serve's
  # asyncio loop), Mimi's quantizer graphed against eager (knowledge/stt_bench.py); then the same engine's
  # batch-1 tick, whose Mimi now graphs its quantizer too (against batch1-off's figures).
  # First, on CUDA, that the graphed quantizer gives the eager codes and audio (tests/test_mimi_graphs.py).
  timeout -k 5 60 "$py" -m pytest -q -p no:cacheprovider tests/test_mimi_graphs.py -k cuda 2>&1 \
    | tee "$out/stt-cuda-test.txt" || echo "bench-gpu: THE CUDA CHECK DID NOT PASS (above: a failed comparison means graphed != eager)" \
    | tee -a "$out/stt-cuda-test.txt"
  run stt 120 stt --checkpoint random:stt-2.6b-en --batch 16,64 --ticks 60 --json "$out/stt.json"
  run stt-engine-b1 120 engine --size moshi-7b --batch 1 --context 3000 --ticks 300 --phases --paced \
    --json "$out/stt-engine-b1.json"
fi
if [[ $what == batch1 || $what == all ]]; then
  # Batch-1 latency (issue 15): the official step against --compile (engine/compiled_step.py), phase by
  # phase, at the 4-minute context; --paced: 300 more ticks on the 80 ms clock, as served (+24 s each). On an
  # H200 (session 23) `off` took 76 s in all with --profile, `default` 195 s (143 s of it the compile warm-up). --profile: whether the slow ticks (p99 twice p50 there) are the GPU busier
  # or idle waiting on the host, and a trace of them (engine-<compile>-b1.trace.json.gz, a few MB).
  for c in off default; do
    case $c in off) t=120 ;; default) t=300 ;; esac
    run "batch1-$c" "$t" engine --size moshi-7b --batch 1 --context 3000 --ticks 300 --compile "$c" --phases \
      --paced --profile "$out" --json "$out/batch1-$c.json"
  done
fi
if [[ $what == compiled-int8 || $what == all ]]; then
  # The compiled tick with the 8-bit cache, at 1 and 64 calls: two compiles (a batch size is a compile of
  # its own), so 64 may run out of time; batch 1's figures are kept either way.
  run compiled-int8 570 engine --size moshi-7b --batch 1,64 --context 3000 --kv-dtype int8 \
    --compile default --phases --json "$out/compiled-int8.json"
fi
if [[ $what == batch1-autotune ]]; then
  # Inductor's autotuned matmuls for the LM (Mimi as default, no coordinate-descent tuning: a warm-up
  # that may fit; all of max-autotune does not): only worth a deployment's start-up if it beats default.
  run batch1-max-autotune-lm 570 engine --size moshi-7b --batch 1 --context 3000 --ticks 300 \
    --compile max-autotune-lm --phases --json "$out/batch1-max-autotune-lm.json"
fi
if [[ $what == batch1-no-main ]]; then
  # Everything but the main transformer compiled: on the H100 compiling it cost 2 ms (8.80 -> 10.76) while
  # the depformer's steps halved (session 21). Against batch1's off and default rows (same machine kind).
  run batch1-default-no-main 250 engine --size moshi-7b --batch 1 --context 3000 --ticks 300 \
    --compile default-no-main --phases --paced --json "$out/batch1-default-no-main.json"
fi
if [[ $what == weights || $what == all ]]; then
  # 8-bit weights (engine/weight_quant.py): ~7.4 GB freed for KV caches (calls past 64 on an H100 with the
  # int8 cache). Eager, the int8 matmul dequantizes each weight every step (slower than bf16: the figure says
  # by how much). torch's own CUDA int8 kernel is a reference kernel, not measured.
  run weights 300 engine --size moshi-7b --batch 1,64,80 --context 3000 --kv-dtype int8 \
    --weights-dtype int8 --json "$out/weights.json"
fi
if [[ $what == weights-autotune || $what == all ]]; then
  # Batch 1 with int8 weights where inductor can fuse the conversion into its autotuned matmul (as
  # batch1-autotune: the LM's matmuls autotuned, Mimi as default).
  run batch1-int8w-autotune-lm 570 engine --size moshi-7b --batch 1 --context 3000 --ticks 300 \
    --weights-dtype int8 --compile max-autotune-lm --phases --json "$out/batch1-int8w-autotune-lm.json"
fi
if [[ $what == kv-cache || $what == kv || $what == all ]]; then
  # What the 8-bit caches cost in accuracy at full size: greedy steps against the bf16 cache (5 runs:
  # the reference, then each format free-running and teacher-forced; JSON written after each format).
  # On the H100 a run of 200 steps takes ~31 s and the model ~13 s to make (session 28): ~170 s in all.
  run kv-cache 280 kv --size moshi-7b --context 3000 --steps 200 --kv-dtype int8,fp8 --weights-dtype auto \
    --json "$out/kv-cache.json"
fi
if [[ $what == kv-weights || $what == kv || $what == all ]]; then
  # 8-bit weights alone and with the int8 cache (7 runs: the reference, then KV int8, weights int8 and both,
  # each free-running and teacher-forced). 200 steps: 231 s on a warm H100 (session 28; 300 steps ran out
  # of the 280 s after KV int8); the teacher-forced error covers every step and there is no wrap before
  # 3000, so more steps would only repeat it.
  run kv-weights 280 kv --size moshi-7b --context 3000 --steps 200 --kv-dtype int8 --weights-dtype int8 \
    --json "$out/kv-weights.json"
fi
if [[ $what == node-48 || $what == node-64 || $what == node-64-stt-thread || $what == node || $what == all ]]; then
  # The whole node (issue 15) with no weights on the box: KAME random at full size, the STT in Kyutai's
  # 2.6B layout with random weights on the same GPU, a local LLM stand-in; the callers' voices come from
  # VOICES, default var/voices (made beforehand where flite is: scripts/gpu-carry.sh). WEIGHTS: bf16
  # (auto, the default) serves 48 calls and the STT on an H100; int8 weights, eager, are too slow to keep
  # time beside the STT (H100, session 21); 64 calls with this STT on bf16 weights need ~82 of an H100's
  # 85.5 GB (docs/benchmarks.md): an H200 if that runs out. serve's log: OUTDIR/node-N.serve.log.
  # node-64-stt-thread: the STT as before --stt-process, a thread beside serve's event loop (its GIL), to
  # set against node-64.
  case $what in node-48) counts=48 ;; node-64*) counts=64 ;; *) counts="48 64" ;; esac
  stt_process=--stt-process name=node
  [[ $what == node-64-stt-thread ]] && stt_process=--no-stt-process name=node-stt-thread
  for calls in $counts; do
    # --hold: 25 s on the line after the question (HOLD), so most of a call is past the burst of starts.
    KAME_STT_CHECKPOINT=random:stt-2.6b-en run "$name-$calls" 270 node --calls "$calls" --hold "${HOLD:-25}" \
      --checkpoint random:moshi-7b --voices "${VOICES:-var/voices}" --serve-arg=--stt=kyutai \
      --serve-arg="$stt_process" \
      --serve-arg=--kv-dtype=int8 --serve-arg=--weights-dtype="${WEIGHTS:-auto}" --serve-arg=--context=3000 \
      --json "$out/$name-$calls.json"
  done
fi
if [[ $what == oracle || $what == all ]]; then
  # 32 calls, the engine in its own process as served: a fixed TTFT (the target's setting), then varying.
  for jitter in 0 100; do
    run "oracle-$jitter" 200 oracle --size moshi-7b --calls 32 --seconds 20 --context 2000 \
      --engine-process --llm-ttft-jitter-ms "$jitter" --json "$out/oracle-$jitter.json"
  done
fi
if [[ $what == media || $what == all ]]; then
  # The phone edge alone (no model), 200 calls: one edge process, then two and four on one engine link.
  for edges in 1 2 4; do
    run "media-$edges" 120 media --calls 200 --seconds 20 --edges "$edges" \
      $([[ $edges == 1 ]] || echo --engine-link) --json "$out/media-$edges.json"
  done
fi
