"""One batched engine tick: Mimi encode -> KAME LM step -> Mimi decode, for a fixed set of call slots.

Rows are call slots. A row joins by a per-row reset (moshi resets KV caches, conv states and offsets in
place with masks) and sits out by its execution mask, so calls come and go without disturbing the others
and the batch shape never changes (which keeps CUDA graphs valid). This class is synchronous and owns no
thread: the frame loop drives it, and tests step it directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch
from moshi.models.compression import MimiModel
from moshi.models.lm import LMGen
from moshi.utils import compile as moshi_compile

from .interface import FRAME_SAMPLES
from .kv_cache import kv_cache_bytes, set_kv_dtype
from .memory_check import check_slots_fit, device_memory
from .mimi_graphs import graph_quantizer
from .model import KameLM, KameStreamingState
from .sampling import SamplingConfig
from .weight_quant import Int8Linear, weights_bytes

log = logging.getLogger(__name__)

UNGENERATED = -2  # moshi's "not generated yet" token


@dataclass(frozen=True)
class StepResult:
    pcm: np.ndarray  # [B, FRAME_SAMPLES] float32, zeros where not voiced
    text: np.ndarray  # [B] int64 text token, UNGENERATED where the row produced nothing
    voiced: np.ndarray  # [B] bool: the row produced audio codes this step
    codes: np.ndarray  # [B, dep_q] int64 audio codes the row's audio was decoded from (0 where not voiced)


@dataclass(frozen=True)
class ModelMemory:
    """What sizes a node, as served: the model's weights and its KV cache for every slot."""

    weights_dtype: str
    weights_bytes: int
    kv_dtype: str
    kv_cache_bytes: int
    slots: int
    context: int

    def describe(self) -> str:
        return (f"weights {self.weights_dtype} {self.weights_bytes / 1e9:.2f} GB, KV cache {self.kv_dtype} "
                f"{self.kv_cache_bytes / 1e9:.2f} GB ({self.slots} slots at context {self.context} frames)")


class KameBatch:
    def __init__(
        self, lm: KameLM, mimi: MimiModel, batch_size: int, sampling: SamplingConfig | None = None,
        kv_dtype: str = "auto", compile_mode: str = "off",
    ):
        sampling = sampling or SamplingConfig()
        self.sampling = sampling
        if lm.device.type != "cuda":
            # moshi torch.compiles a few kernels lazily; on CPU that costs tens of seconds per shape on
            # first use (stalling the first calls) for no real gain, so it stays off there.
            moshi_compile._compile_disabled = True
        self.lm = lm
        self.mimi = mimi
        self.batch_size = batch_size
        self.device = lm.device
        # support_out_of_sync: a reset row must not make step() return None for every row.
        self.lm_gen = LMGen(
            lm,
            use_sampling=sampling.use_sampling,
            temp=sampling.temp,
            temp_text=sampling.temp_text,
            top_k=sampling.top_k,
            top_k_text=sampling.top_k_text,
            support_out_of_sync=True,
        )
        # Before streaming allocates them: the main transformer's KV caches in 8 bits, or moshi's own.
        self.kv_dtype = kv_dtype
        set_kv_dtype(lm.transformer, kv_dtype)
        # What sizes a node: the operator sees it once at start (docs/benchmarks.md has the table), and the
        # frame loop exports it (kame_engine_model_bytes).
        self.memory = ModelMemory(
            weights_dtype="int8" if any(isinstance(m, Int8Linear) for m in lm.modules()) else "auto",
            weights_bytes=weights_bytes(lm),
            kv_dtype=kv_dtype,
            kv_cache_bytes=kv_cache_bytes(lm, batch_size, kv_dtype),
            slots=batch_size,
            context=lm.transformer.layers[0].self_attn.context,
        )
        log.info("model memory: %s", self.memory.describe())
        # Before streaming makes the caches: a node sized past its device is refused in one line, not
        # failed minutes later in an allocation deep inside moshi.
        free = device_memory(self.device)
        if free is not None:
            check_slots_fit(free, kv_cache_bytes=self.memory.kv_cache_bytes, slots=batch_size,
                            width=lm.transformer.layers[0].self_attn.embed_dim, kv_dtype=kv_dtype,
                            context=self.memory.context)
        # Entered for the life of this object; `close()` leaves streaming so the modules can be reused. A
        # construction that fails half way leaves it too: the next batch on these modules must find them
        # out of streaming, with no graphs of this one's size (the quantizer's) left on them.
        self._streaming = ExitStack()
        try:
            self._streaming.enter_context(self.lm_gen.streaming(batch_size))
            self._streaming.enter_context(self.mimi.streaming(batch_size))
            self._streaming.enter_context(graph_quantizer(self.mimi))  # the codebooks' launches as graphs
            self.compile_mode = compile_mode
            if compile_mode != "off":
                from .compiled_step import compile_tick  # torch.compile's machinery only where it is asked for

                self._streaming.enter_context(compile_tick(self.lm_gen, self.mimi, batch_size, compile_mode))
            state = lm._streaming_state
            assert isinstance(state, KameStreamingState) and state.oracle is not None
            self._oracle = state.oracle  # [B, 1], read by the (graphed) LM step
            pin = self.device.type == "cuda"
            self._pcm_in = torch.zeros(batch_size, 1, FRAME_SAMPLES, dtype=torch.float32, pin_memory=pin)
            self._oracle_in = torch.zeros(batch_size, 1, dtype=torch.long, pin_memory=pin)
        except BaseException:
            self._streaming.close()
            raise
        self._active = np.zeros(batch_size, dtype=bool)
        self._fresh = np.zeros(batch_size, dtype=bool)  # joined, first encode not done yet
        self._mask_cache: dict[bytes, torch.Tensor] = {}

    def close(self) -> None:
        """Free the streaming state (KV caches, graphs): last entered, first left, each left even if one
        before it fails."""
        self._streaming.close()

    def _mask(self, rows: np.ndarray) -> torch.Tensor:
        key = rows.tobytes()
        mask = self._mask_cache.get(key)
        if mask is None:
            mask = torch.from_numpy(rows.copy()).to(self.device)
            if len(self._mask_cache) < 4096:
                self._mask_cache[key] = mask
        return mask

    def reset_rows(self, rows: np.ndarray) -> None:
        """A new call takes these rows: clear their LM, oracle and Mimi state."""
        if not rows.any():
            return
        mask = self._mask(rows)
        self.lm_gen.reset_streaming(mask)
        self.mimi.reset_streaming(mask)
        self._fresh |= rows

    @torch.no_grad()
    def step(
        self, pcm: np.ndarray, active: np.ndarray, oracle: np.ndarray | Callable[[], np.ndarray]
    ) -> StepResult:
        """Advance every active row by one 80 ms frame.

        pcm: [B, FRAME_SAMPLES] float32 caller audio (silence for inactive rows); active: [B] bool;
        oracle: [B] int64, the oracle token each row feeds this step, or a function returning it, called
        as late as possible (after the Mimi encode is issued) so a draft that lands meanwhile still makes
        this tick.
        """
        B = self.batch_size
        assert pcm.shape == (B, FRAME_SAMPLES), pcm.shape
        self._pcm_in[:, 0].copy_(torch.from_numpy(np.ascontiguousarray(pcm, dtype=np.float32)))
        active_mask = self._mask(active)
        self.lm_gen.set_exec_mask(active_mask)
        self.mimi.set_exec_mask(active_mask)

        codes = self.mimi.encode(self._pcm_in.to(self.device, non_blocking=True))
        first = self._fresh & active
        if first.any():
            # moshi's first-frame rule, per row: the first encoded frame carries the encoder's left
            # padding; reset the row's Mimi state so the next frame gets it again.
            self.mimi.reset_streaming(self._mask(first))
            self._fresh &= ~first

        tokens = oracle() if callable(oracle) else oracle
        self._oracle_in[:, 0].copy_(torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)))
        # In place into the buffer the captured graph reads.
        self._oracle.copy_(self._oracle_in, non_blocking=True)
        out = self.lm_gen.step(codes)  # [B, 1 + dep_q, 1]
        assert out is not None  # support_out_of_sync never returns None
        audio = out[:, 1:, :]
        voiced = (audio >= 0).all(dim=2).all(dim=1) & active_mask
        # Never decode UNGENERATED: give those rows a valid code and keep their decoder frozen.
        audio = torch.where(voiced[:, None, None], audio, torch.zeros_like(audio))
        self.mimi.set_exec_mask(voiced)
        pcm_out = self.mimi.decode(audio)[:, 0, :] * voiced[:, None]
        text = out[:, 0, 0]  # moshi already wrote UNGENERATED for rows that produced nothing
        # One device->host copy per tick (codes < 2^24 are exact in float32).
        packed = torch.cat(
            [pcm_out.float(), text[:, None].float(), voiced[:, None].float(), audio[:, :, 0].float()], dim=1
        ).cpu().numpy()
        return StepResult(
            pcm=packed[:, :FRAME_SAMPLES].astype(np.float32, copy=False),
            text=packed[:, FRAME_SAMPLES].astype(np.int64),
            voiced=packed[:, FRAME_SAMPLES + 1] > 0.5,
            codes=packed[:, FRAME_SAMPLES + 2 :].astype(np.int64),
        )
