"""8-bit weights (`--weights-dtype int8`): the transformers' linear layers in one byte a weight.

The main transformer and the depformer hold 7.4 of the 7.8 B parameters (15.6 GB in bf16). Stored as int8
codes with one scale per output channel (absmax / 127, symmetric, weight-only: activations stay in the
compute dtype), they take half that. What it buys on a GPU is memory: what is freed goes to KV caches, or
to an STT model on the same GPU (the whole-node figure). Batch-1 latency (a step reads every weight once)
gains only where the conversion is fused into the matmul, see below; eager, a tick gets slower.
Embeddings and the output heads (text and audio logits) stay as they are: they are a small share of the
bytes and the logits are what sampling reads. So does everything with `auto`, which keeps the step token
for token equal to the official code.

How the matmul runs (`set_int8_matmul(model, kind)`, `kame-phone bench engine --int8-matmul`):
- `aten`: `torch._weight_int8pack_mm`, one kernel reading the int8 codes. On CPU it is a tuned kernel; on
  CUDA (torch 2.13) it is a reference kernel, one thread per output element looping over K with strided
  reads, far slower than cuBLAS: not for serving there;
- `dequant`: `linear(x, codes.to(dtype)) * scale`. Eager, it writes a bf16 copy of each weight every step
  (5 bytes moved a weight against bf16's 2: slower than bf16 weights, the price of the memory); under
  `--compile max-autotune`, inductor can fuse the conversion into its matmul template (prologue fusion);
- `auto` (the default): `aten` on CPU, `dequant` elsewhere.
Both compute the same values (tested); which is fastest at which batch on a GPU is measured, not assumed
(docs/benchmarks.md).

Per-output-channel scales come out of the sum: (x · (s·c)ᵀ) = (x · cᵀ)·s, so a row of output needs one
multiply. The accuracy cost is measured against the unquantized weights by `kame-phone bench kv`
(engine/quant_accuracy.py), on CPU at tiny size in the tests.
"""

from __future__ import annotations

import logging

import torch
from moshi.modules.gating import ActivationGating, gating_forward_generic
from torch import nn
from torch.nn import functional as F

log = logging.getLogger(__name__)

WEIGHTS_DTYPES = ("auto", "int8")
INT8_MATMULS = ("auto", "aten", "dequant")

_aten_ok: dict[str, bool] = {}  # "device type:dtype" -> torch._weight_int8pack_mm runs there


def _aten_available(device: torch.device, dtype: torch.dtype) -> bool:
    key = f"{device.type}:{dtype}"
    if key not in _aten_ok:
        try:
            x = torch.ones(1, 16, device=device, dtype=dtype)
            w = torch.ones(16, 16, device=device, dtype=torch.int8)
            torch._weight_int8pack_mm(x, w, torch.ones(16, device=device, dtype=dtype))
            _aten_ok[key] = True
        except (RuntimeError, NotImplementedError) as e:
            log.info("int8 weights: no _weight_int8pack_mm on %s for %s (%s); dequantizing in the matmul instead",
                     device.type, dtype, str(e).splitlines()[0][:120])
            _aten_ok[key] = False
    return _aten_ok[key]


def _use_aten(kind: str, device: torch.device, dtype: torch.dtype) -> bool:
    if kind == "auto":
        kind = "aten" if device.type == "cpu" else "dequant"
    return kind == "aten" and _aten_available(device, dtype)


class Int8Linear(nn.Linear):
    """An `nn.Linear` (no bias in these models) whose weight is int8 codes [out, in] and a scale per output
    channel [out] in the compute dtype. Subclassing nn.Linear keeps moshi's attention accepting it: moshi
    reads `in_proj.weight`'s device and dtype to type the KV cache, which `weight` (empty) still gives."""

    def __init__(self, linear: nn.Linear, matmul: str = "auto") -> None:
        nn.Module.__init__(self)
        if linear.bias is not None:
            raise ValueError("Int8Linear: a linear layer with a bias is not expected in these models")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        w32 = w.float()
        scale = w32.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        codes = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        del w32
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale.to(w.dtype))
        self.register_parameter("bias", None)
        self.use_matmul(matmul)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        # Device and dtype only (all moshi reads of a self-attention projection); any real use of it fails
        # loudly on its shape rather than silently dequantizing every step.
        return self.scale[:0]

    def use_matmul(self, kind: str) -> None:
        """Which matmul this layer runs (module docstring); its own, so two models in a process differ."""
        if kind not in INT8_MATMULS:
            raise ValueError(f"unknown int8 matmul {kind!r}; expected one of {', '.join(INT8_MATMULS)}")
        self._use_aten = _use_aten(kind, self.codes.device, self.scale.dtype)

    def dequantized(self) -> torch.Tensor:
        return self.codes.to(self.scale.dtype) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_aten:
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.codes, self.scale)
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.codes.to(x.dtype)) * self.scale

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, matmul={self.kernel}"

    @property
    def kernel(self) -> str:
        return "aten" if self._use_aten else "dequant"


class Int8Gating(ActivationGating):
    """moshi's gated FFN calling its (int8) linear modules: its own fast path reads `.weight` directly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gating_forward_generic(self.linear_in, self.linear_out, self.activation, x)


def set_int8_matmul(model: nn.Module, kind: str) -> None:
    """Which matmul `model`'s int8 layers run. Before compiling or capturing the step: a graph keeps the
    kernel it traced."""
    if kind not in INT8_MATMULS:  # also for a model with no int8 layer: a typo is an error either way
        raise ValueError(f"unknown int8 matmul {kind!r}; expected one of {', '.join(INT8_MATMULS)}")
    for m in model.modules():
        if isinstance(m, Int8Linear):
            m.use_matmul(kind)


def quantize_weights(lm: nn.Module, kind: str) -> int:
    """Replaces every linear layer of `lm`'s main transformer and depformer by an `Int8Linear` (in place,
    once: the unquantized weights are freed). Returns how many layers it replaced; "auto" does nothing.
    Call it before streaming is entered (moshi types the KV caches from the projections then)."""
    if kind not in WEIGHTS_DTYPES:
        raise ValueError(f"unknown weights dtype {kind!r}; expected one of {', '.join(WEIGHTS_DTYPES)}")
    if kind == "auto":
        return 0
    count = 0
    parts = [p for p in (getattr(lm, "transformer", None), getattr(lm, "depformer", None)) if p is not None]
    for part in parts:
        for module in list(part.modules()):
            if getattr(module, "_streaming_state", None) is not None:
                raise RuntimeError("quantize_weights must be called before streaming() is entered")
            if type(module) is ActivationGating:
                module.__class__ = Int8Gating
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, name, Int8Linear(child))
                    count += 1
    device = next(iter(lm.parameters())).device
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the bf16 weights' blocks, for the KV caches to come
    return count


def weights_bytes(lm: nn.Module) -> int:
    """The model's parameters and buffers (int8 codes and their scales included)."""
    return sum(t.numel() * t.element_size() for t in (*lm.parameters(), *lm.buffers()))
