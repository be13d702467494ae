"""The fused float32 small ops (kvkernels/cpu_fused_ops.cpp) against the torch ops they replace, and a float32
model through them against the same model through torch's. They need AVX2 and FMA; the skip says which is
missing (ARM, old x86)."""

import pytest
import torch
import torch.nn.functional as F

from kvkernels import cpu_fused_ops
from kvroute.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.model.llama import apply_rope

MISSING = cpu_fused_ops.unsupported_reason()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"fused CPU ops: {MISSING}")
CLOSE = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_fused_ops.load_kernel()


def rows(t: int, n: int, seed: int, padded: bool = False) -> torch.Tensor:
    """[t, n] float32, optionally a view of wider rows (a row stride the ops must honour)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n + 3 if padded else n, generator=gen)
    return x[:, :n] if padded else x


@pytest.mark.parametrize("t", [0, 1, 5, 300])
@pytest.mark.parametrize("n", [576, 100, 7])  # whole vectors, a 4-float tail, a row shorter than one vector
@pytest.mark.parametrize("padded", [False, True])
def test_rms_norm_and_add_rms_norm_match_torch(t, n, padded):
    x, residual, weight = rows(t, n, 0, padded), rows(t, n, 1, padded), rows(1, n, 2)[0]
    torch.testing.assert_close(cpu_fused_ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (n,), weight, 1e-5), **CLOSE)
    total = residual + x
    fused_x, fused_residual = x.clone(), residual.clone()
    cpu_fused_ops.add_rms_norm_(fused_x, fused_residual, weight, 1e-5)
    assert torch.equal(fused_residual, total)
    torch.testing.assert_close(fused_x, F.rms_norm(total, (n,), weight, 1e-5), **CLOSE)


@pytest.mark.parametrize("t", [0, 1, 33])
@pytest.mark.parametrize("width", [1536, 20, 3])
def test_silu_and_mul_matches_torch(t, width):
    gate_up = 4 * rows(t, 2 * width, 3)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_fused_ops.silu_and_mul(gate_up), F.silu(gate) * up, **CLOSE)


def test_silu_saturates_like_torch_at_extreme_gates():
    gate = torch.tensor([[-1e30, -1e4, -100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1e4, 1e30, -0.0]])
    gate_up = torch.cat([gate, torch.ones_like(gate)], dim=1)
    out = cpu_fused_ops.silu_and_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate), atol=1e-30, rtol=1e-6)
    nan = cpu_fused_ops.silu_and_mul(torch.tensor([[float("nan")] * 8 + [1.0] * 8]))
    assert nan.isnan().all()


@pytest.mark.parametrize("t, heads, head_dim", [(1, 12, 64), (40, 4, 32), (7, 2, 128), (5, 3, 20)])
def test_rope_in_place_matches_rotate_half(t, heads, head_dim):
    """On q and k as one view of the fused qkv output (a token stride wider than the heads), at any position."""
    qkv = rows(t, (heads + 1) * head_dim, 4)
    x = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(4096).float(), inv_freq)
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(5))
    cos, sin = table[positions].chunk(2, dim=-1)
    expected = apply_rope(x, torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([sin, sin], -1).unsqueeze(1))
    untouched = qkv[:, heads * head_dim :].clone()
    cpu_fused_ops.rope_(x, table, positions)
    torch.testing.assert_close(x, expected, **CLOSE)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)  # v's columns are not written


def test_bad_inputs_are_refused_not_read_out_of_bounds():
    table = torch.zeros(16, 8)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        cpu_fused_ops.rope_(torch.zeros(2, 1, 8), table, torch.tensor([3, 16]))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_fused_ops.rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        cpu_fused_ops.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-5)


def test_float32_model_gives_the_same_logits_and_tokens_through_the_fused_ops(monkeypatch):
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=64))
    prompt = list(range(3, 43))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert cpu_fused_ops.available(torch.zeros(1))
    fused_logits = engine.prompt_logits(prompt)  # before any request caches the prompt's blocks
    with monkeypatch.context() as torch_ops:
        torch_ops.setattr(cpu_fused_ops, "available", lambda x: False)
        torch.testing.assert_close(engine.prompt_logits(prompt), fused_logits, atol=1e-4, rtol=1e-4)
        torch_tokens = engine.generate([prompt], greedy)[0].token_ids
    assert engine.generate([prompt], greedy)[0].token_ids == torch_tokens
    engine.check_invariants()
