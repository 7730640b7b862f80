"""Mimi's quantizer in CUDA graphs: the part of its encode and decode that moshi leaves eager.

moshi runs Mimi's SEANet encoder/decoder and its two transformers inside CUDA graphs, but not the
residual vector quantizer between them: each codebook is a handful of small kernels launched one by one
from Python (a projection, a distance, an argmin, a lookup, a subtraction). Measured on an H200 (session 23,
docs/benchmarks.md): Kyutai STT's Mimi (32 codebooks) spent 359 of its encode's 379 launches there, 11.6 ms
of a 22 ms step at 64 rows with nothing else running, and each launch gives up and takes back the GIL
(every torch op does), so beside a busy asyncio loop in the same process the step stretched to 34-48 ms.
The engine's Mimi (8 codebooks) runs 95 such launches a tick encoding and 37 decoding, time a batch-1 tick
(15 ms target) spends on the host.

The quantizer is a pure function of its input (no streaming state, nothing data-dependent in eval mode),
so a graph of it replays the same kernels on the same values: the tokens do not change
(tests/test_mimi_graphs.py checks it on CUDA). Graphs need a fixed shape, so the wrapping lasts one
streaming session of one batch size. On CPU (and with moshi's NO_CUDA_GRAPH=1) it calls straight through.

Not graphed: the frame-rate convolutions on either side of the quantizer (5 more launches a tick). The
downsampling one pads by replicating, and its streaming state rebinds `state.first` to a new tensor each
step instead of writing it in place: a graph would keep reading the first step's tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from moshi.models.compression import MimiModel
from moshi.utils.compile import CUDAGraphed

_METHODS = ("encode", "decode")


def quantizer_is_graphed(mimi: MimiModel) -> bool:
    return all(isinstance(vars(mimi.quantizer).get(name), CUDAGraphed) for name in _METHODS)


def quantizer_graphs_captured(mimi: MimiModel, methods: tuple[str, ...] = _METHODS) -> bool:
    """Graphed, and the graphs of `methods` captured (so replayed since): False on CPU or with
    NO_CUDA_GRAPH=1. An STT only encodes: its decode graph is never captured, so it asks for ("encode",)."""
    return quantizer_is_graphed(mimi) and all(vars(mimi.quantizer)[name]._graph is not None for name in methods)


def graph_quantizer(mimi: MimiModel) -> ExitStack:
    """Until the returned stack is closed, `mimi.quantizer.encode` and `.decode` run as CUDA graphs
    (captured on their second call; the first, eager, also builds the codebooks' cached embeddings). Call
    with Mimi streaming at the batch size it will keep (as moshi's `streaming()`, the stack comes entered);
    once it is closed the quantizer's own methods are back, so the next batch size captures graphs of its
    own shape."""
    stack = ExitStack()
    quantizer = mimi.quantizer
    disable = next(mimi.parameters()).device.type != "cuda"
    for name in _METHODS:
        # Always graphs of its own, over the class's method: graphs found in place (another holder's, or left
        # by a batch that failed half way) were captured at some other batch size. Whatever was there is put
        # back on close.
        before = vars(quantizer).get(name)
        setattr(quantizer, name, CUDAGraphed(getattr(type(quantizer), name).__get__(quantizer), disable=disable))
        stack.callback(_restore, quantizer, name, before)
    return stack


def _restore(quantizer: object, name: str, before: object) -> None:
    if before is None:
        vars(quantizer).pop(name, None)  # an instance attribute shadows the method: gone, the method is back
    else:
        vars(quantizer)[name] = before


@contextmanager
def quantizer_eager(mimi: MimiModel) -> Iterator[None]:
    """The quantizer's own (eager) methods for a while, its graphs kept for after: a benchmark's A/B."""
    saved = {name: vars(mimi.quantizer).pop(name) for name in _METHODS if name in vars(mimi.quantizer)}
    try:
        yield
    finally:
        vars(mimi.quantizer).update(saved)
