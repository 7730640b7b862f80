"""The KAME front-end: moshi's LMModel with a fourth stream, the oracle.

KAME sums an extra text embedding, `oracle_emb` (built like `text_emb`, `[text_card + 1, dim]`), into the
text input at every step. Unlike the official code, which keeps one oracle sequence for the whole batch,
each batch row here reads its own oracle token from a fixed `[B, 1]` buffer in the streaming state: the
frame loop writes one token per row per tick in place, so captured CUDA graphs stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from moshi.models.lm import LMModel
from moshi.models.lm_utils import ScaledEmbedding, _init_layer
from moshi.modules.streaming import State

# Oracle stream vocabulary (as trained): the text initial token (32000 at full size) marks a new
# candidate, then its SentencePiece tokens, then text padding (3) when there is nothing to say.
ORACLE_PAD = 3


@dataclass
class KameStreamingState(State):
    """Streaming state of the LM with a per-row oracle token, `oracle` [B, 1] (long)."""

    oracle: torch.Tensor | None = None
    pad_id: int = ORACLE_PAD

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.oracle is None:
            self.oracle = torch.full((self.batch_size, 1), self.pad_id, dtype=torch.long, device=self.device)

    def reset(self, reset_mask: torch.Tensor) -> None:
        super().reset(reset_mask)
        assert self.oracle is not None
        # In place: a captured CUDA graph reads this exact storage.
        self.oracle.masked_fill_(reset_mask[:, None], self.pad_id)


class KameLM(LMModel):
    """LMModel + `oracle_emb`; text input = text_emb(text) + oracle_emb(oracle)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        factory_kwargs = {"device": self.text_emb.weight.device, "dtype": self.text_emb.weight.dtype}
        # Same kind of embedding as text_emb: same norm and demux settings (not stored as attributes).
        self.oracle_emb = ScaledEmbedding(
            self.text_card + 1,
            self.dim,
            norm=self.text_emb.norm is not None,
            zero_idx=-1,
            demux_second_stream=self.text_emb.demux_second_stream,
            **factory_kwargs,
        )
        if self.text_emb.weight.device.type != "meta":
            _init_layer(self.oracle_emb)  # as KAME's _init_weights does for it

    @property
    def oracle_start_token_id(self) -> int:
        """Boundary token fed on the step a new candidate starts (32000 at full size)."""
        return self.text_initial_token_id

    def _init_streaming_state(self, batch_size: int) -> KameStreamingState:
        device = next(iter(self.parameters())).device
        return KameStreamingState(batch_size, device, pad_id=self.text_padding_token_id)

    def forward_text(
        self,
        sequence: torch.Tensor,
        sum_condition: torch.Tensor | None = None,
        cross_attention_src: torch.Tensor | None = None,
        oracle_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LMModel.forward_text, with `oracle_tokens` [B, S] (or the streaming buffer) added to text."""
        B, K, S = sequence.shape
        assert K == self.num_codebooks, f"Sequence shape {sequence.shape} must match the number of codebooks."
        if oracle_tokens is None:
            state = self._streaming_state
            if state is not None:
                assert isinstance(state, KameStreamingState) and state.oracle is not None
                oracle_tokens = state.oracle
            else:
                oracle_tokens = torch.full(
                    (B, S), self.text_padding_token_id, dtype=torch.long, device=sequence.device
                )
        assert oracle_tokens.shape == (B, S), f"oracle {tuple(oracle_tokens.shape)} != {(B, S)}"
        input_ = None
        for cb_index in range(self.num_audio_codebooks):
            audio_emb = self.emb[cb_index](sequence[:, cb_index + self.audio_offset])
            input_ = audio_emb if input_ is None else input_ + audio_emb
        # KAME's order: audio + (text + oracle), so bf16 sums match the official model.
        text_emb = self.text_emb(sequence[:, 0]) + self.oracle_emb(oracle_tokens)
        input_ = text_emb if input_ is None else input_ + text_emb
        if sum_condition is not None:
            input_ = input_ + sum_condition.to(input_)
        if cross_attention_src is not None:
            cross_attention_src = cross_attention_src.to(input_)
        transformer_out = self.transformer(input_, cross_attention_src=cross_attention_src)
        if self.out_norm:
            transformer_out = self.out_norm(transformer_out)
        assert isinstance(transformer_out, torch.Tensor)
        text_logits = self.text_linear(transformer_out)[:, None]
        return transformer_out, text_logits
