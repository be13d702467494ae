"""Weight-only int8 / int4 models (`--weights`): the portable backend against the format's reference, the tiny
model and SmolLM2 through the engine, memory, and bad input."""

from __future__ import annotations

import pytest
import torch

from kvkernels import torch_weight_only, weight_only
from kvroute.model_source import resolve_model
from kvroute.sampling import SamplingParams
from launch.cli import main as cli_main
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.model import LlamaForCausalLM, WeightQuantization, load_model
from worker.model.quantized_linear import (
    QuantizedEmbedding,
    QuantizedLinear,
    decode_arithmetic_for_every_step,
    weight_only_backend,
)
from worker.model.tiny import tiny_config, tiny_weights, write_hf_dir

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Here is a list of fruits: apple, banana,"]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_the_torch_backend_meets_the_contract(bits: int, group_size: int) -> None:
    gen = torch.Generator().manual_seed(bits * group_size)
    weight = weight_only.quantize(torch.randn(80, 384, generator=gen), bits, group_size, symmetric=bits == 8)
    packed = torch_weight_only.pack(weight)
    assert packed.nbytes() == weight.nbytes()  # int4 two a byte
    assert torch.equal(torch_weight_only.dequantize(packed, torch.float32), weight_only.dequantize(weight))
    rows = torch.tensor([79, 0, 5, 5])
    expected = weight_only.dequantize(weight, torch.bfloat16)[rows]
    assert torch.equal(torch_weight_only.dequantize_rows(packed, rows, torch.bfloat16), expected)
    x, bias = torch.randn(7, 384, generator=gen), torch.randn(80, generator=gen)
    out = torch_weight_only.linear(x, packed, bias)
    ref = weight_only.reference_linear(x, weight, bias)
    assert out.dtype == torch.float32 and torch.allclose(out.double(), ref, rtol=0, atol=1e-5 * ref.abs().max())


def model_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers, each tensor once (a tied table is one)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def float32_bytes(model: LlamaForCausalLM) -> int:
    with torch.device("meta"):
        return model_bytes(LlamaForCausalLM(model.config))


def run_and_check(engine: LLMEngine, max_tokens: int = 4) -> list[list[int]]:
    prompts = [engine.tokenizer.encode(text, add_special_tokens=True) for text in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)
    engine.check_invariants()
    assert not engine.has_unfinished_requests()
    assert all(len(r.token_ids) == max_tokens for r in results)
    return [r.token_ids for r in results]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_tiny_model_runs_quantized(weights: str) -> None:
    engine = LLMEngine(EngineConfig(model="tiny", weights=weights, weight_scheme="sym", num_kv_blocks=32))
    tokens = run_and_check(engine)
    assert engine.runner.weights.startswith(f"{weights} g128 x 10")  # type: ignore[attr-defined]
    assert run_and_check(engine) == tokens  # the prefix cache serves the same tokens


def test_smollm2s_q4_1_blocks_as_int8_and_int4_give_the_float32_paths_greedy_tokens() -> None:
    """Both carry the file's own numbers (a Q4_1 block widened to int8 is exact), so only summation order can
    differ from the float32 model, which dequantises the same blocks."""
    reference = run_and_check(LLMEngine(EngineConfig(model="smollm2", dtype="float32", num_kv_blocks=32)), 6)
    for weights in ("int8", "int4"):
        engine = LLMEngine(EngineConfig(model="smollm2", dtype="float32", weights=weights, num_kv_blocks=32))
        assert run_and_check(engine, 6) == reference, weights


def test_smollm2_in_int4_takes_under_035x_its_float32_bytes_and_keeps_no_float_matrix() -> None:
    model, config = load_model(resolve_model("smollm2"), torch.float32, "cpu", WeightQuantization(4, None, False))
    ratio = model_bytes(model) / float32_bytes(model)
    assert ratio <= 0.35, ratio
    assert all(p.dim() == 1 for p in model.parameters())  # norms only: no float copy of a matrix
    embedding, lm_head = model.model.embed_tokens, model.lm_head
    assert isinstance(embedding, QuantizedEmbedding) and isinstance(lm_head, QuantizedLinear)
    assert lm_head.packed is embedding.packed  # tied: one table
    assert embedding.bits == 8  # the file's Q8_0 table, kept: no group size was asked
    assert {m.bits for m in model.modules() if isinstance(m, QuantizedLinear) and m is not lm_head} == {4}


def test_a_bf16_model_takes_float32_to_the_kernel_and_gets_bf16_back() -> None:
    weight = weight_only.quantize(torch.randn(64, 128), 4, 32, symmetric=False)
    layer = QuantizedLinear.from_weight(weight, weight_only_backend("cpu").module)
    layer.dequantize_above_rows = 2  # the backend's linear for this decode-sized step, whatever the backend
    x = torch.randn(2, 128).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), weight_only.reference_linear(x, weight).float(), rtol=1e-2, atol=1e-2)
    assert layer(torch.randn(3, 128).to(torch.bfloat16)).dtype == torch.bfloat16  # dequantize + GEMM


def test_an_unknown_weights_value_is_refused_by_both_commands(capsys) -> None:
    for command in ("generate", "worker"):
        with pytest.raises(SystemExit) as exit_info:
            cli_main([command, "--model", "tiny", "--prompt", "hi", "--weights", "int3"])
        assert exit_info.value.code == 2
        assert "--weights: invalid choice: 'int3'" in capsys.readouterr().err


def test_a_group_size_that_does_not_divide_a_layer_is_refused_naming_it(tmp_path, capsys, tokenizer_smollm2) -> None:
    config = tiny_config(hidden_size=96, intermediate_size=192, head_dim=24)  # 96 inputs: 32 divides, 64 not
    model_dir = write_hf_dir(tmp_path / "odd", config, tiny_weights(config), tokenizer_smollm2)
    argv = ["generate", "--model", str(model_dir), "--prompt", "hi", "--weights", "int4", "--weight-group-size", "64"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "--weight-group-size 64 does not divide model.embed_tokens's 96 input features" in err
    assert "choose one of 32" in err
    model, _ = load_model(resolve_model(str(model_dir)), torch.float32, "cpu", WeightQuantization(4, None, True))
    assert {m.group_size for m in model.modules() if isinstance(m, QuantizedLinear)} == {32}  # the largest fit


def test_teacher_forced_logits_can_take_the_decode_kernels_arithmetic() -> None:
    """decode_arithmetic_for_every_step (kvroute quality's distance): a prompt's logits computed through the decode
    `linear` at every step size, as one-token steps compute them, and the many-row path back afterwards."""
    engine = LLMEngine(EngineConfig(model="tiny", weights="int4", weight_scheme="sym", num_kv_blocks=32))
    model = engine.runner.model  # type: ignore[attr-defined]
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    prompt = engine.tokenizer.encode(PROMPTS[0] * 8, add_special_tokens=True)
    assert len(prompt) > layers[0].dequantize_above_rows
    calls: list[int] = []
    backend = layers[0].backend
    original = backend.linear

    def counting_linear(x, packed, bias):
        calls.append(x.shape[0])
        return original(x, packed, bias)

    backend.linear = counting_linear
    try:
        engine.prompt_logits(prompt)
        assert calls == []  # a prefill's rows take dequantized_linear
        with decode_arithmetic_for_every_step(model):
            engine.prompt_logits(prompt)
        assert len(calls) == len(layers) and set(calls) == {len(prompt)}
    finally:
        backend.linear = original
    assert all(m.dequantize_above_rows < len(prompt) for m in layers)
    engine.check_invariants()
