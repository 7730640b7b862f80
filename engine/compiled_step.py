"""`--compile`: torch.compile for everything a tick runs inside CUDA graphs: the LM's main transformer, its
depformer steps, and Mimi's encoder, decoder and their transformers.

At batch 1 a tick is GPU time spent in thousands of small kernels rather than in reading weights
(docs/benchmarks.md: LM step 13.9 ms against a ~5 ms bandwidth floor on an H100, Mimi 2.2 ms each way):
every layer's norms, rotary embedding, ring bookkeeping, gating and residuals are separate launches, and
the depformer makes 48 layer passes a tick. Inductor fuses them. The compiled functions still run inside
moshi's CUDA graphs (`CUDAGraphed`: one eager call, which compiles, then capture), so the compile never
uses graphs of its own.

Three things in moshi's step do not trace as they are, and are handled:
- `LMGen.depformer_step` enters and leaves the depformer's streaming mode every tick (an ExitStack, which
  dynamo refuses). Here the depformer streams for the batch's life and is rewound in place at the start of
  each tick to exactly a fresh state: offsets, ring ends and ring contents to zero, exec mask to all rows.
- moshi compiles a few functions on its own (norms, rotary embedding, gating; lazily, on first use): under
  `no_compile()` they are plain code that the enclosing graph takes in, as on CPU, where moshi's own
  compiling is always off.
- The transformers' `offset_cpu` counters (Python ints, +1 a step) are only read to pick per-step weights,
  which only the depformer has; each would make dynamo recompile every tick. They are held at 0 before
  each call (checked: one set of weights per layer).
- The main transformer's KV ring is written with `index_put_` instead of moshi's `scatter_`
  (`InPlaceRingKVCache`, engine/kv_cache.py): compiled, a `scatter_` copied each layer's whole ring every
  tick (1.45 ms at batch 1 on an H200).
tests/test_compiled_step.py checks the tokens against the uncompiled step, and that nothing recompiles.

`off` (the default) is the official step, token for token; `default` and `max-autotune` are inductor's
settings (the latter autotunes kernels: minutes of warm-up). `max-autotune-lm` autotunes the LM's matmul
templates only (where int8 weights' conversion can fuse into the matmul), without coordinate-descent tuning
of every fused kernel, and compiles Mimi as `default`: a warm-up short enough for a bench's 10 minutes.
`default-no-main` compiles the depformer's steps and Mimi (`default`) and leaves the main transformer as the
official step: on the H100 compiling made it slower and the rest faster.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from moshi.models.compression import MimiModel
from moshi.models.lm import LMGen
from moshi.modules.streaming import State
from moshi.modules.transformer import StreamingMultiheadAttention, _LayerState, _MHAState, _TransformerState
from moshi.utils.compile import no_compile
from moshi.utils.sampling import sample_token

from .kv_cache import write_in_place

COMPILE_MODES = ("off", "default", "max-autotune", "max-autotune-lm", "default-no-main")
# torch.compile's "max-autotune-no-cudagraphs" as inductor options (a mode and options do not mix).
_INDUCTOR_OPTIONS: dict[str, dict[str, bool]] = {
    "default": {},
    "default-no-main": {},
    "max-autotune": {"max_autotune": True, "coordinate_descent_tuning": True},
    "max-autotune-lm": {"max_autotune": True},  # for the LM; Mimi as below
}
_MIMI_MODE = {"max-autotune-lm": "default", "default-no-main": "default"}  # Mimi's mode where not the LM's
# Modes that leave the main transformer as the official step: on an H100 it ran 2 ms slower compiled (10.76
# against 8.80 ms at batch 1, context 3000) while the depformer's steps ran twice as fast (docs/benchmarks.md).
_EAGER_MAIN = frozenset({"default-no-main"})


def _states(module: torch.nn.Module) -> list[State]:
    return [s for m in module.modules() if (s := getattr(m, "_streaming_state", None)) is not None]


def _zero_offset_cpu(states: list[State]) -> None:
    for s in states:
        if isinstance(s, (_MHAState, _LayerState)):
            s.offset_cpu = 0


def _rewind(states: list[State]) -> None:
    """The tensor half of a fresh streaming state, in place (so a CUDA graph's replay does it too)."""
    for s in states:
        s.exec_mask.fill_(True)
        if isinstance(s, _MHAState):
            s.offset.zero_()
            if s.kv_cache is not None:
                s.kv_cache.end_offset.zero_()
                # Contents too: masked-out slots still enter attention as 0 x value, and a NaN left there
                # (an idle row's all-masked softmax, with --kv-dtype int8) would leak into the next tick.
                s.kv_cache.cache.zero_()
        elif isinstance(s, _TransformerState):
            s.offsets.zero_()
        elif not isinstance(s, _LayerState):
            # A moshi upgrade added streaming state this rewind does not know: refuse rather than reuse it.
            raise TypeError(f"cannot rewind depformer state {type(s).__name__}")


def _check_single_weights(module: torch.nn.Module) -> None:
    """No per-step weights anywhere in `module`: what makes its offset_cpu counters dead."""
    for m in module.modules():
        if (isinstance(m, StreamingMultiheadAttention) and len(m.in_projs) != 1) or getattr(m, "weights_per_step", 0):
            raise ValueError(f"{type(module).__name__} has per-step weights: its step cannot be compiled here")


def _compile(fn: Callable[..., Any], options: dict[str, bool]) -> Callable[..., Any]:
    # Graph breaks are allowed (not fullgraph): inside a CUDA graph they cost nothing after capture, and the
    # 8-bit KV attention breaks on purpose to keep its own autotuned kernel (engine/kv_cache.py).
    return torch.compile(fn, dynamic=False, options=options)


class _Pinned:
    """A compiled function whose module's (dead) offset_cpu counters are held at 0 before each call."""

    def __init__(self, fn: Callable[..., Any], module: torch.nn.Module, options: dict[str, bool]) -> None:
        _check_single_weights(module)
        self._states = _states(module)
        self._compiled = _compile(fn, options)

    def __call__(self, *args: Any) -> Any:
        _zero_offset_cpu(self._states)
        with no_compile():
            return self._compiled(*args)


class PersistentDepformerStep:
    """moshi's `LMGen.depformer_step` (no CFG) over a depformer that streams for the batch's life."""

    def __init__(self, lm_gen: LMGen, batch_size: int, exit_stack: ExitStack) -> None:
        lm = lm_gen.lm_model
        assert lm.depformer is not None and not lm.depformer.is_streaming
        if lm_gen.cfg_coef != 1.0:
            raise ValueError("the compiled step does not do classifier-free guidance (cfg_coef != 1)")
        self.lm_gen = lm_gen
        exit_stack.enter_context(lm.depformer.streaming(batch_size))
        self._states = _states(lm.depformer)
        _rewind(self._states)  # checks every state kind once, here, not at the first tick
        self.steps: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._steps

    def _steps(self, text_token: torch.Tensor, transformer_out: torch.Tensor) -> torch.Tensor:
        _rewind(self._states)
        lm_gen, lm = self.lm_gen, self.lm_gen.lm_model
        prev = text_token
        tokens = []
        for cb_index in range(lm.dep_q):
            logits = lm.forward_depformer(cb_index, prev[:, None, None], transformer_out)
            prev = sample_token(logits.float(), lm_gen.use_sampling, lm_gen.temp, lm_gen.top_k)[:, 0, 0]
            tokens.append(prev)
        return torch.stack(tokens, dim=1)

    def __call__(self, text_token: torch.Tensor, transformer_out: torch.Tensor) -> torch.Tensor:
        # The Python half of the rewind, outside the compiled code: its guards then always see 0.
        _zero_offset_cpu(self._states)
        with no_compile():
            return self.steps(text_token, transformer_out)


def compile_tick(lm_gen: LMGen, mimi: MimiModel, batch_size: int, mode: str) -> ExitStack:
    """Swap the functions behind the tick's CUDA graphs (the LM's main transformer and depformer steps,
    Mimi's encoder, decoder and their transformers) for compiled ones. Call with `lm_gen` and `mimi`
    streaming and before the first step; close the returned stack before they leave streaming. Compiling
    itself happens on the first step (the frame loop's warm-up)."""
    if mode not in _INDUCTOR_OPTIONS:
        raise ValueError(f"compile mode must be one of {', '.join(_INDUCTOR_OPTIONS)}, got {mode!r}")
    lm_state, mimi_state = lm_gen._streaming_state, mimi._streaming_state
    assert lm_state is not None and lm_state.graphed_depth is not None, "enter lm_gen.streaming() first"
    assert mimi_state is not None, "enter mimi.streaming() first"
    # fallback_random: sampling draws from the same generator as eager, so a seeded run is reproducible
    # across --compile settings (the exponential draws are a few small kernels a step).
    options = {"fallback_random": True, **_INDUCTOR_OPTIONS[mode]}
    mimi_options = {"fallback_random": True, **_INDUCTOR_OPTIONS[_MIMI_MODE.get(mode, mode)]}
    # Each batch size is its own compiled entry, twice for Mimi's two transformers (one code object): a
    # bench over six sizes would pass dynamo's default of 8 and silently run the rest eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    lm = lm_gen.lm_model
    stack = ExitStack()
    depformer = PersistentDepformerStep(lm_gen, batch_size, stack)
    depformer.steps = _compile(depformer.steps, options)  # type: ignore[assignment]
    lm_state.graphed_depth.func = depformer
    if mode not in _EAGER_MAIN:
        lm_state.graphed_main.func = _Pinned(lm.forward_text, lm.transformer, options)
        # The ring written in place: compiled, moshi's scatter_ copies each layer's whole ring every tick.
        write_in_place(lm.transformer)
    for graphed in (mimi_state.graphed_encoder, mimi_state.graphed_decoder,
                    mimi_state.graphed_tr_enc, mimi_state.graphed_tr_dec):
        if graphed is not None:
            graphed.func = _Pinned(graphed.func, graphed.func, mimi_options)
    return stack
