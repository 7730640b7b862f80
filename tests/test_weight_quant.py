"""8-bit weights (`--weights-dtype int8`): the layers, the model, the accuracy cost, the flags, a call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moshi.modules.gating import ActivationGating
from prometheus_client import REGISTRY
from torch import nn

from engine.checkpoint import load_kame
from engine.quant_accuracy import measure
from engine.weight_quant import Int8Gating, Int8Linear, quantize_weights, set_int8_matmul, weights_bytes
from kame_phone.cli import main
from telephony.sim_caller import simulate_call

from .phone_fixtures import running_phone


@pytest.mark.parametrize("matmul", ["aten", "dequant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_layer_computes_its_dequantized_weights_product(matmul: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=False, dtype=dtype)
    w = linear.weight.detach().float().clone()
    q = Int8Linear(linear, matmul)
    assert q.codes.dtype == torch.int8 and q.codes.shape == (40, 96) and q.scale.dtype == dtype
    # Round to nearest: each weight within half a step of its row's scale; a bf16 scale is off by up to 2^-9
    # of itself, 127 codes x that = another quarter step at most.
    step = w.abs().amax(dim=1, keepdim=True) / 127
    slack = 0.5 if dtype == torch.float32 else 0.75
    assert ((q.codes.float() * q.scale.float()[:, None] - w).abs() <= slack * step * 1.001).all()
    assert q.codes.abs().amax(dim=1).eq(127).all()  # each row's largest weight uses the full range
    x = torch.randn(3, 5, 96, dtype=dtype)[:, 1:4]  # [B, T, C], not contiguous, as moshi slices it
    got = q(x)
    want = nn.functional.linear(x.float(), q.dequantized().float())
    assert got.shape == (3, 3, 40) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    # What moshi reads of a projection to type its KV cache: the compute dtype and device.
    assert q.weight.dtype == dtype and q.weight.device == w.device and q.weight.numel() == 0
    assert q.kernel == matmul  # both run on CPU
    assert Int8Linear(linear).kernel == "aten"  # auto: the tuned CPU kernel; on CUDA auto is dequant
    assert q.kernel == matmul  # a layer's choice is its own, not a class-wide default


def test_quantizing_a_model_replaces_the_transformers_linears_and_only_those(tiny_checkpoint: Path) -> None:
    bundle = load_kame(str(tiny_checkpoint))
    lm = bundle.lm
    before = weights_bytes(lm)
    inside = ("transformer.", "depformer.")
    heads = {n: p.detach().clone() for n, p in lm.named_parameters() if not n.startswith(inside)}
    linears = [n for n, m in lm.named_modules() if type(m) is nn.Linear and n.startswith(inside)]
    shapes = [dict(lm.named_modules())[n].weight.shape for n in linears]
    assert quantize_weights(lm, "int8") == len(linears) > 0
    modules = dict(lm.named_modules())
    assert all(isinstance(modules[n], Int8Linear) for n in linears)
    assert not any(type(m) is nn.Linear for n, m in lm.named_modules() if n.startswith(inside))
    assert not any(type(m) is ActivationGating for m in lm.modules())
    assert any(isinstance(m, Int8Gating) for m in lm.modules())
    # Embeddings and the output heads stay as loaded.
    for name, p in lm.named_parameters():
        if name in heads:
            assert torch.equal(p, heads[name]), name
    # What stays a parameter inside the transformers is the norms' gains (one value per channel).
    left = {n: p for n, p in lm.named_parameters() if n.startswith(inside)}
    assert left and all(p.numel() == p.shape[-1] for p in left.values()), list(left)
    # Each float32 weight becomes one byte, plus a float32 scale per output row; nothing else changes.
    saved = sum(out * inp * 4 - (out * inp + out * 4) for out, inp in shapes)
    assert weights_bytes(lm) == before - saved and saved > 0.25 * before  # embeddings: most of the rest
    with pytest.raises(ValueError, match="unknown weights dtype"):
        quantize_weights(lm, "int4")
    # The matmul is chosen per model: switching one leaves another model in the process as it was.
    other = load_kame(str(tiny_checkpoint)).lm
    quantize_weights(other, "int8")
    set_int8_matmul(lm, "dequant")
    assert {m.kernel for m in lm.modules() if isinstance(m, Int8Linear)} == {"dequant"}
    assert {m.kernel for m in other.modules() if isinstance(m, Int8Linear)} == {"aten"}
    with pytest.raises(ValueError, match="unknown int8 matmul"):
        set_int8_matmul(lm, "cublas")
    with lm.streaming(1), pytest.raises(RuntimeError, match="before streaming"):
        quantize_weights(lm, "int8")


def test_the_accuracy_cost_over_500_greedy_steps(tiny_checkpoint: Path) -> None:
    """The figure the issue asks for, at tiny size: against the unquantized model on the same inputs."""
    bundle = load_kame(str(tiny_checkpoint))
    lines: list[str] = []
    results = measure(bundle.lm, bundle.mimi, ["int8"], ["int8"], steps=500, log=lines.append)
    by = {(r.kv_dtype, r.weights_dtype): r for r in results}
    assert set(by) == {("int8", "auto"), ("auto", "int8"), ("int8", "int8")}
    assert [ln.split(":")[0] for ln in lines] == ["kv int8", "weights int8", "weights int8 + kv int8"]
    for r in results:
        assert r.steps == 500 and r.batch == 2
        assert 0.0 <= r.text_agreement <= 1.0 and 0.0 < r.token_agreement < 1.0
        # Close, not equal: the logits move by about the format's rounding until a token flips (random
        # weights: greedy decoding is chaotic, so a flip comes within steps; docs/benchmarks.md).
        assert r.first_divergence_step is not None and r.first_divergence_step >= 1
        assert 0.0 < r.logit_rel_err < 0.1, r
        # Fed the reference's tokens, over all 500 steps (the tiny ring wraps every 64): the variant's own
        # greedy picks agree at least 95 % of the time and its logits move by about the format's rounding.
        assert 0.95 < r.forced_text_top1 < 1.0 and 0.95 < r.forced_audio_top1 < 1.0, r
        assert 0.0 < r.forced_text_rel_err_mean < 0.05 and r.forced_text_rel_err < 0.1, r
    # The model keeps its 8-bit weights afterwards (quantizing is in place, once).
    assert any(isinstance(m, Int8Linear) for m in bundle.lm.modules())


def test_the_accuracy_bench_command(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    assert main(["bench", "kv", "--checkpoint", str(tiny_checkpoint), "--steps", "20", "--kv-dtype", "auto",
                 "--json", str(out)]) == 0
    (only,) = json.loads(out.read_text())  # --kv-dtype auto: the weights alone
    assert only["weights_dtype"] == "int8" and only["kv_dtype"] == "auto" and only["steps"] == 20
    assert main(["bench", "kv", "--weights-dtype", "int4"]) == 2
    assert main(["bench", "kv", "--weights-dtype", "auto", "--kv-dtype", "auto"]) == 2


def test_engine_bench_reports_its_weights(tmp_path: Path) -> None:
    def bench(*extra: str) -> dict:  # type: ignore[type-arg]
        out = tmp_path / f"bench{len(extra)}.json"
        assert main(["bench", "engine", "--size", "tiny", "--batch", "2", "--ticks", "3", "--warmup", "1",
                     "--device", "cpu", *extra, "--json", str(out)]) == 0
        return json.loads(out.read_text())  # type: ignore[no-any-return]

    plain, eight = bench(), bench("--weights-dtype", "int8", "--int8-matmul", "dequant")
    assert plain["weights_dtype"] == "auto" and plain["int8_matmul"] is None
    assert eight["weights_dtype"] == "int8" and eight["int8_matmul"] == "dequant"
    assert eight["weights_gb"] < 0.75 * plain["weights_gb"]  # float32 at tiny size: 4 bytes -> 1
    assert len(eight["results"]) == 1 and eight["results"][0]["ticks"] == 3
    assert main(["bench", "engine", "--weights-dtype", "int4"]) == 2


async def test_a_phone_call_on_int8_weights_and_cache_in_the_engine_process(
    tiny_checkpoint: Path, question_wav: Path
) -> None:
    """What a dense deployment runs (`--weights-dtype int8 --kv-dtype int8`), served as deployed: the model in
    its own process, loaded and quantized there; what it holds is exported where it is scraped."""
    async with running_phone(tiny_checkpoint, kv_dtype="int8", weights_dtype="int8", engine_process=True) as phone:
        memory = phone.engine.frame_loop.memory
        assert memory is not None and (memory.weights_dtype, memory.kv_dtype) == ("int8", "int8")
        plain = load_kame(str(tiny_checkpoint))
        assert memory.weights_bytes < 0.75 * weights_bytes(plain.lm)
        assert REGISTRY.get_sample_value("kame_engine_model_bytes", {"part": "weights"}) == memory.weights_bytes
        assert REGISTRY.get_sample_value("kame_engine_model_bytes", {"part": "kv_cache"}) == memory.kv_cache_bytes > 0
        report = await simulate_call(phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base,
                                     hold_after=1.0)
    assert report.outcome == "completed", report.errors
    assert report.bot_seconds_received > 0.6 * report.call_seconds  # in real time
    assert report.first_audio_latency_s is not None
