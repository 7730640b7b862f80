"""What 8-bit storage costs in accuracy: the same model, the same inputs, greedy, once as it is (the
reference: weights and KV cache in the compute dtype) and once per variant: an 8-bit KV cache
(`--kv-dtype`), 8-bit weights (`--weights-dtype`), or both (what a dense deployment runs).

Two runs per variant:
- free-running, as served: token agreement (the share of text and audio tokens equal to the reference's
  over all steps and rows), the first step where any token differs, and the text-logit error while the
  two runs still agree (after a difference they see different tokens and their logits stop being
  comparable);
- teacher-forced: the variant fed the reference's own tokens at every step (each head's greedy pick is
  overridden with the reference's), so its logits stay comparable over all steps, past the KV cache's
  wrap: the text- and audio-logit error (max |Δ|, and ‖Δ‖/‖ref‖ per step: worst and mean) and top-1
  agreement (the variant's own greedy pick equal to the reference's, given the same history).
With random weights greedy decoding is chaotic (flat logits: a near tie flips at the first nudge), so the
free run's agreement says little there and the teacher-forced figures are the ones that transfer.
`kame-phone bench kv` runs it; the tests run it at tiny size on CPU; docs/benchmarks.md has the full-size
figures when a GPU was at hand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from moshi.utils.compile import no_cuda_graph

from .batch import KameBatch
from .interface import FRAME_SAMPLES
from .model import KameLM
from .sampling import SamplingConfig
from .weight_quant import quantize_weights

GREEDY = SamplingConfig(use_sampling=False)


@dataclass
class QuantAccuracy:
    kv_dtype: str
    weights_dtype: str
    steps: int
    batch: int
    token_agreement: float  # share of (text + audio) tokens equal to the reference run's
    text_agreement: float
    first_divergence_step: int | None  # None: identical throughout
    logit_max_abs_err: float  # over the steps before the first divergence
    logit_rel_err: float  # worst step's ||delta|| / ||reference||
    # Teacher-forced (fed the reference's tokens), over every step:
    forced_text_top1: float  # share of (step, row) whose greedy text pick equals the reference's
    forced_audio_top1: float  # the same over every audio codebook
    forced_text_max_abs_err: float
    forced_text_rel_err: float  # worst step
    forced_text_rel_err_mean: float
    forced_audio_rel_err: float  # worst (step, codebook)
    forced_audio_rel_err_mean: float

    @property
    def label(self) -> str:
        parts = [f"weights {self.weights_dtype}"] if self.weights_dtype != "auto" else []
        if self.kv_dtype != "auto" or not parts:
            parts.append(f"kv {self.kv_dtype}")
        return " + ".join(parts)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class _Run:
    tokens: np.ndarray  # [steps, B, 1 + dep_q] as the batch returned them (moshi's delays applied)
    logits: list[torch.Tensor]  # text head, per step [B, text_card] float32 (CPU)
    audio_logits: list[list[torch.Tensor]]  # per audio codebook, per step [B, card] float32 (CPU)

    def picks(self) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Each head's greedy pick per step ([B] long): what moshi's sampler took from these logits."""
        return ([x.argmax(-1) for x in self.logits], [[x.argmax(-1) for x in cb] for cb in self.audio_logits])


class _Heads:
    """Forward hooks on the text head and the depformer's per-codebook heads (each runs once per step, in
    order): they record each head's logits and, teacher-forcing, replace them by a one-hot of the
    reference's pick, so greedy sampling feeds the reference's token on (the recorded logits are the
    variant's own)."""

    def __init__(self, lm: KameLM, force: _Run | None) -> None:
        self.text: list[torch.Tensor] = []
        self.audio: list[list[torch.Tensor]] = [[] for _ in range(lm.dep_q)]
        self._picks = force.picks() if force is not None else None
        self._hooks = [lm.text_linear.register_forward_hook(self._hook(self.text, 0))]
        self._hooks += [head.register_forward_hook(self._hook(self.audio[k], k + 1))
                        for k, head in enumerate(lm.linears[: lm.dep_q])]

    def _hook(self, into: list[torch.Tensor], head: int) -> Callable[..., torch.Tensor | None]:
        def hook(_module: torch.nn.Module, _inputs: object, out: torch.Tensor) -> torch.Tensor | None:
            step = len(into)
            into.append(out.reshape(out.shape[0], -1).float().cpu())
            if self._picks is None:
                return None
            want = self._picks[0][step] if head == 0 else self._picks[1][head - 1][step]
            one_hot = torch.zeros_like(out).reshape(out.shape[0], -1)
            one_hot[torch.arange(out.shape[0]), want.to(out.device)] = 1
            return one_hot.reshape(out.shape)
        return hook

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def _inputs(lm: KameLM, batch: int, steps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    pcm = (0.1 * rng.standard_normal((steps, batch, FRAME_SAMPLES))).astype(np.float32)
    oracle = rng.integers(4, min(lm.text_card, 30000), size=(steps, batch))
    return pcm, oracle


def _run(lm: KameLM, mimi, kv_dtype: str, pcm: np.ndarray, oracle: np.ndarray,  # type: ignore[no-untyped-def]
         force: _Run | None = None) -> _Run:
    steps, batch = oracle.shape
    heads = _Heads(lm, force)
    kb = KameBatch(lm, mimi, batch, GREEDY, kv_dtype=kv_dtype)
    try:
        # Eager on a GPU: a CUDA graph's replay would not call the hook (and its capture refuses the copy).
        with no_cuda_graph():
            active = np.ones(batch, dtype=bool)
            kb.reset_rows(active)
            tokens = []
            for t in range(steps):
                out = kb.step(pcm[t], active, oracle[t])
                tokens.append(np.concatenate([out.text[:, None], out.codes], axis=1))
    finally:
        kb.close()
        heads.remove()
    return _Run(np.stack(tokens), heads.text, heads.audio)


def _errors(ref: list[torch.Tensor], run: list[torch.Tensor]) -> tuple[float, list[float]]:
    """max |delta| over the steps, and each step's ||delta|| / ||reference||."""
    max_abs, rel = 0.0, []
    for a, b in zip(ref, run, strict=True):
        max_abs = max(max_abs, float((b - a).abs().max()))
        rel.append(float((b - a).norm() / a.norm().clamp_min(1e-12)))
    return max_abs, rel


def _top1(ref: list[torch.Tensor], run: list[torch.Tensor]) -> float:
    return float(torch.stack([a.argmax(-1) == b.argmax(-1) for a, b in zip(ref, run, strict=True)])
                 .float().mean()) if ref else 1.0


def _compare(ref: _Run, run: _Run, forced: _Run, kv_dtype: str, weights_dtype: str) -> QuantAccuracy:
    steps, batch = ref.tokens.shape[:2]
    same = run.tokens == ref.tokens
    differs = np.flatnonzero(~same.all(axis=(1, 2)))
    first = int(differs[0]) if len(differs) else None
    # The text head runs once per step: logits[i] belongs to step i. From the first differing step on,
    # the two free runs may be fed different tokens, so only the steps before it are compared.
    upto = len(ref.logits) if first is None else first
    max_abs, rel = _errors(ref.logits[:upto], run.logits[:upto])
    # Teacher-forced: the same history as the reference at every step.
    text_abs, text_rel = _errors(ref.logits, forced.logits)
    audio_rel = [r for a, b in zip(ref.audio_logits, forced.audio_logits, strict=True) for r in _errors(a, b)[1]]
    audio_top1 = [_top1(a, b) for a, b in zip(ref.audio_logits, forced.audio_logits, strict=True)]
    return QuantAccuracy(
        kv_dtype, weights_dtype, steps, batch, float(same.mean()), float(same[:, :, 0].mean()), first,
        max_abs, max(rel, default=0.0),
        forced_text_top1=_top1(ref.logits, forced.logits),
        forced_audio_top1=float(np.mean(audio_top1)) if audio_top1 else 1.0,
        forced_text_max_abs_err=text_abs,
        forced_text_rel_err=max(text_rel, default=0.0),
        forced_text_rel_err_mean=float(np.mean(text_rel)) if text_rel else 0.0,
        forced_audio_rel_err=max(audio_rel, default=0.0),
        forced_audio_rel_err_mean=float(np.mean(audio_rel)) if audio_rel else 0.0,
    )


def measure(
    lm: KameLM, mimi, kv_dtypes: list[str], weights_dtypes: list[str] | None = None,  # type: ignore[no-untyped-def]
    steps: int = 500, batch: int = 2, seed: int = 0, log: Callable[[str], None] = print,
    on_result: Callable[[list[QuantAccuracy]], None] | None = None,
) -> list[QuantAccuracy]:
    """Each KV format with the weights as they are; then, per weights format, the weights quantized (in
    place: `lm` keeps them 8-bit afterwards) with the KV cache as it is and with each KV format.
    `on_result` gets the results so far after each variant: a run cut short (a GPU call's time limit)
    keeps what it measured."""
    pcm, oracle = _inputs(lm, batch, steps, seed)
    ref = _run(lm, mimi, "auto", pcm, oracle)
    variants = [(kv, "auto") for kv in kv_dtypes]
    for weights in weights_dtypes or []:
        variants += [(kv, weights) for kv in ["auto", *[k for k in kv_dtypes if k != "auto"]]]
    results = []
    quantized = "auto"
    for kv, weights in variants:
        if weights != quantized:
            if quantized != "auto":
                raise ValueError("one 8-bit weights format per measurement (quantizing is in place)")
            quantize_weights(lm, weights)
            quantized = weights
        r = _compare(ref, _run(lm, mimi, kv, pcm, oracle), _run(lm, mimi, kv, pcm, oracle, force=ref), kv, weights)
        log(f"{r.label}: token agreement {r.token_agreement:.4f} (text {r.text_agreement:.4f}), first divergence "
            f"at step {r.first_divergence_step}, text logits before it: max |d| {r.logit_max_abs_err:.4g}, "
            f"worst relative {r.logit_rel_err:.4g}; teacher-forced over all steps: top-1 text "
            f"{r.forced_text_top1:.4f} audio {r.forced_audio_top1:.4f}, text logits max |d| "
            f"{r.forced_text_max_abs_err:.4g}, relative mean {r.forced_text_rel_err_mean:.4g} worst "
            f"{r.forced_text_rel_err:.4g}, audio logits relative mean {r.forced_audio_rel_err_mean:.4g} worst "
            f"{r.forced_audio_rel_err:.4g}")
        results.append(r)
        if on_result is not None:
            on_result(list(results))
    return results


def run_quant_accuracy(
    size: str, device: str, kv_dtypes: list[str], weights_dtypes: list[str], steps: int = 500,
    context: int | None = None, dtype: str | None = None, batch: int = 2, checkpoint: str | None = None,
    log: Callable[[str], None] = print, on_result: Callable[[list[QuantAccuracy]], None] | None = None,
) -> list[QuantAccuracy]:
    """`kame-phone bench kv`: a checkpoint's weights when one is named (the figure that transfers to a
    deployment), else the named size with random weights (tiny on CPU; moshi-7b on a GPU)."""
    from .bench import bench_dtype
    from .checkpoint import load_kame, load_random

    dev = torch.device(device)
    if checkpoint is None and size != "tiny" and dev.type != "cuda":
        raise SystemExit(f"size {size} needs a CUDA GPU; use --size tiny on CPU")
    torch_dtype = bench_dtype(dev, dtype)
    torch.set_grad_enabled(False)
    if checkpoint is not None:
        bundle = load_kame(checkpoint, dev, torch_dtype, context)
    else:
        bundle = load_random(size, dev, torch_dtype, context)
    log(f"# 8-bit accuracy: {checkpoint or size} on {device}, {torch_dtype}, {steps} greedy steps x {batch} rows, "
        f"against {torch_dtype} weights and cache")
    return measure(bundle.lm, bundle.mimi, kv_dtypes, weights_dtypes, steps=steps, batch=batch, log=log,
                   on_result=on_result)
