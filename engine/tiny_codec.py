"""The tiny checkpoint's Mimi: random weights, but a codec whose codes follow the audio and back.

A freshly built Mimi has all-zero codebooks (moshi fills them by k-means during training), so every
frame encodes to code 0 and every code decodes to the same audio: no test on such a codec can notice an
audio-path bug or audio crossing between batch rows. Two fixes, both needed:
- PyTorch's default init shrinks the signal at every SEANet layer while each bias adds to it, so the
  encoder's latents and the decoder's audio are mostly biases. Variance-preserving weights and zero
  biases make each follow its input.
- Each residual codebook gets k-means centroids of what the encoder makes of synthetic speech, so
  different callers give different codes (and every code is in use).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from moshi.models.compression import MimiModel
from scipy.signal import lfilter
from torch import nn

SAMPLE_RATE = 24_000


def speech_like(seconds: float, seed: int) -> np.ndarray:
    """Syllables of voiced sound (a jittered glottal pulse train through three formant resonators), some
    hissed consonants and pauses: the spectral and temporal shape of speech, at 24 kHz, float32."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    total = int(seconds * SAMPLE_RATE)
    while sum(len(x) for x in out) < total:
        n = int(rng.uniform(0.08, 0.3) * SAMPLE_RATE)
        kind = rng.choice(["voiced", "voiced", "voiced", "hiss", "pause"])
        if kind == "pause":
            out.append(0.003 * rng.standard_normal(n))
            continue
        if kind == "hiss":
            x = lfilter([1.0, -0.95], [1.0], rng.standard_normal(n)) * 0.05  # high-tilted noise
        else:
            f0 = rng.uniform(90, 260) * (1 + 0.1 * np.linspace(-1, 1, n) * rng.choice([-1, 1]))
            phase = np.cumsum(f0 / SAMPLE_RATE)
            x = (np.diff(np.floor(phase), prepend=0.0) > 0).astype(np.float64)  # one pulse per period
            for formant in (rng.uniform(300, 900), rng.uniform(900, 2500), rng.uniform(2400, 3500)):
                r, theta = 0.97, 2 * np.pi * formant / SAMPLE_RATE
                x = lfilter([1 - r], [1.0, -2 * r * np.cos(theta), r * r], x)
            x *= 0.3 / (np.abs(x).max() + 1e-9)
        out.append(x * np.hanning(n))  # syllable envelope
    return np.concatenate(out)[:total].astype(np.float32)


def _kmeans(x: torch.Tensor, k: int, gen: torch.Generator, iters: int = 30) -> torch.Tensor:
    centroids = x[torch.randperm(len(x), generator=gen)[:k]].clone()
    for _ in range(iters):
        assign = torch.cdist(x, centroids).argmin(dim=1)
        for j in range(k):
            members = x[assign == j]
            # An empty cluster takes a random point, so every code stays in use.
            centroids[j] = members.mean(dim=0) if len(members) else x[torch.randint(len(x), (1,), generator=gen)][0]
    return centroids


@torch.no_grad()
def make_codec_responsive(mimi: MimiModel, seconds: float = 6.0, signals: int = 12, seed: int = 0,
                          level: float = 0.1) -> None:
    """In place: re-initialise the SEANet convolutions, fit every codebook, and scale the decoder so the
    fitted codes decode at about `level` RMS (speech level rather than a whisper)."""
    gen = torch.Generator().manual_seed(seed)
    for conv in (m for part in (mimi.encoder, mimi.decoder) for m in part.modules()):
        if isinstance(conv, nn.Conv1d | nn.ConvTranspose1d):
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen) / math.sqrt(_fan_in(conv)))
            if conv.bias is not None:
                conv.bias.zero_()
    audio = torch.from_numpy(np.stack([speech_like(seconds, seed * 1000 + i) for i in range(signals)]))
    codes = _fit_codebooks(mimi, audio[:, None, :], gen)
    last = [m for m in mimi.decoder.modules() if isinstance(m, nn.Conv1d)][-1]
    last.weight.mul_(level / mimi.decode(codes).std().clamp(min=1e-6))


def _fan_in(conv: nn.Conv1d | nn.ConvTranspose1d) -> int:
    # A transposed conv's weight is [in, out / groups, k]: each output sample sums in * k / stride inputs.
    if isinstance(conv, nn.ConvTranspose1d):
        return max(1, conv.in_channels * conv.kernel_size[0] // conv.stride[0])
    return conv.in_channels // conv.groups * conv.kernel_size[0]


def _fit_codebooks(mimi: MimiModel, audio: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill every codebook of `mimi`'s split RVQ (semantic and acoustic) in place; returns `audio`'s codes."""
    latent = mimi._encode_to_unquantized_latent(audio)  # [N, D, frames]
    quantizer = mimi.quantizer
    for rvq in (quantizer.rvq_first, quantizer.rvq_rest):
        projected = rvq.input_proj(latent)  # [N, d, frames]
        residual = projected.transpose(1, 2).reshape(-1, projected.shape[1])
        for layer in rvq.vq.layers:
            book = layer._codebook
            x = layer.project_in(residual)
            centroids = _kmeans(x, book.codebook_size, gen)
            book.embedding_sum.copy_(centroids)  # embedding = embedding_sum / cluster_usage
            book.cluster_usage.fill_(1.0)
            book._initialized.fill_(1.0)
            book.register_buffer("_embedding", None, persistent=False)  # drop the cached zero codebook
            residual = residual - layer.project_out(centroids[torch.cdist(x, centroids).argmin(dim=1)])
    return mimi.quantizer.encode(latent)
