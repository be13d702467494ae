"""`kvroute quality` (quality/): the decision rule's parsing and verdicts, bad specs and prompt files answered with
a UserError (exit 2), a mismatched chat template refused (exit 3) naming where, the reference against itself
passing and a candidate with one layer's weights doubled failing. The tiny model, a handful of prompts, few
tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvkernels import weight_only
from kvroute.errors import UserError
from kvroute.model_source import resolve_model
from kvroute.tokenizer import Tokenizer
from launch.cli import main
from quality.config_spec import parse_config_spec
from quality.decision_rule import parse_rule
from quality.measures import first_divergence, flip_rate, next_token_distance, paired_difference
from quality.prompts import BUILTIN, Prompt, load_prompts
from quality.protocol import Settings, Side, compare
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.model import load_model
from worker.model.quantized_linear import QuantizedLinear
from worker.model_runner import ModelRunner, weight_quantization

SMALL_KV = "kv-cache-memory-gb=0.05"  # the tiny model's cache: enough blocks, little memory to zero
RULE = "flips_above_floor<=0.02,top1>=0.97"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.for_model(resolve_model("tiny"))


def test_decision_rule_parses_strictly_and_judges_each_clause() -> None:
    rule = parse_rule("flips_above_floor <= 0.02, top1>=.97\n# a comment\nlong_top1_late > 9e-1  # tail\n")
    assert str(rule) == "flips_above_floor<=0.02,top1>=0.97,long_top1_late>0.9"
    verdict = rule.judge({"flips_above_floor": 0.02, "top1": 0.969, "long_top1_late": 0.95})
    assert not verdict.passed
    assert [r.holds for r in verdict.results] == [True, False, True]  # <= holds at equality
    assert parse_rule("top1>0.5").judge({"top1": 0.5}).passed is False  # strict
    assert parse_rule("mean_kl<1").judge({"mean_kl": math.nan}).passed is False
    assert parse_rule("flips<0.1,noise_floor<=0.1").judge({"flips": 0.05, "noise_floor": 0.1}).passed


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "at least one clause"),
        ("# only a comment", "at least one clause"),
        ("top1=0.97", "not METRIC OP NUMBER"),
        ("top1=>0.97", "not METRIC OP NUMBER"),
        ("top1>=0.97,", "not METRIC OP NUMBER"),
        ("top1>=nan", "not METRIC OP NUMBER"),
        ("top1>=97%", "not METRIC OP NUMBER"),
        ("accuracy>=0.9", "unknown metric 'accuracy'"),
    ],
)
def test_a_bad_rule_is_a_user_error(text: str, says: str) -> None:
    with pytest.raises(UserError, match=says):
        parse_rule(text)


def test_specs_map_to_engine_configs() -> None:
    spec = parse_config_spec("weights=int4, kv-cache-dtype=fp8,weight_group_size=64,enable-prefix-caching=false", "-c")
    config = spec.engine_config("tiny")
    assert (config.weights, config.kv_cache_dtype, config.weight_group_size) == ("int4", "fp8", 64)
    assert config.enable_prefix_caching is False and spec.chat_template is None
    assert parse_config_spec("", "-c").engine_config("tiny") == EngineConfig(model="tiny")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("weights=int3", "weights must be one of"),
        ("quantization=int4", "unknown key 'quantization'"),
        ("model=tiny", "unknown key 'model'"),
        ("dtype", "is not key=value"),
        ("dtype=float32,dtype=bfloat16", "given twice"),
        ("max-num-seqs=many", "must be an int"),
        ("weight-group-size=48", "weight_group_size must be one of"),
        ("enable-prefix-caching=yes", "true or false"),
        ("chat-template=/nonexistent/template.jinja", "chat-template"),
    ],
)
def test_a_bad_spec_is_a_user_error(spec: str, says: str) -> None:
    with pytest.raises(UserError, match=says):
        parse_config_spec(spec, "--candidate")


def test_a_bad_spec_exits_2_before_any_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quality", "--model", "tiny", "--candidate", "weights=int3", "--accept", RULE]) == 2
    assert "weights must be one of" in capsys.readouterr().err
    assert main(["quality", "--model", "tiny", "--candidate", "dtype=float32", "--accept", "top1>=1.5x"]) == 2
    argv = ["quality", "--model", "tiny", "--candidate", "dtype=float32"]
    assert main([*argv, "--accept-file", "/nonexistent/rule.txt"]) == 2
    assert main([*argv, "--accept", "long_top1>=0.9", "--long-prompts", "0"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent/rule.txt" in err and "reads long_top1, but no long outputs run" in err


def test_measures_arithmetic() -> None:
    logits = torch.randn(5, 11)
    same = next_token_distance(logits, logits)
    assert bool(same.top1.all()) and float(same.kl.max()) < 1e-12
    flat = next_token_distance(logits, torch.zeros(5, 11))
    assert float(flat.kl.min()) > 0
    rate = flip_rate([True] + [False] * 9)
    assert rate.value == 0.1 and rate.half_width == pytest.approx(1.96 * math.sqrt(0.1 * 0.9 / 10))
    # Both flip on prompt 0 (a fragile prompt): pairing leaves the candidate's one extra flip.
    diff = paired_difference([True, True, False, False], [True, False, False, False])
    assert diff.value == 0.25 and diff.half_width == pytest.approx(1.96 * math.sqrt((0.25 - 0.0625) / 4))
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_builtin_prompts_render_under_the_model_template(tokenizer: Tokenizer) -> None:
    prompt_set = load_prompts(BUILTIN, 16)
    assert len(prompt_set.prompts) == 200 and len(prompt_set.long_form) == 16
    rendered = [p.render(tokenizer) for p in prompt_set.prompts]
    assert len({tuple(ids) for ids in rendered}) == 200
    assert all(ids[-3:] == tokenizer.encode_chat([], add_generation_prompt=True)[-3:] for ids in rendered)


def write_prompts(path: Path) -> Path:
    lines = [
        {"messages": [{"role": "user", "content": "What is the capital of Italy?"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]},
        {"prompt": "The three primary colors are"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_prompts_file_loads_chats_and_plain_text(tmp_path: Path, tokenizer: Tokenizer) -> None:
    prompt_set = load_prompts(str(write_prompts(tmp_path / "p.jsonl")), 2)
    assert len(prompt_set.prompts) == 3 and prompt_set.long_form == prompt_set.prompts[:2]
    assert prompt_set.prompts[2] == Prompt(text="The three primary colors are")
    assert prompt_set.prompts[2].render(tokenizer) == tokenizer.encode("The three primary colors are", True)
    bad = tmp_path / "bad.jsonl"
    for line, says in [
        ("not json", "not JSON"),
        ('{"text": "hi"}', "each line is"),
        ('{"prompt": ""}', "non-empty string"),
        ('{"messages": [{"content": "no role"}]}', "non-empty list"),
    ]:
        bad.write_text(line + "\n")
        with pytest.raises(UserError, match=f"{bad}:1: .*{says}"):
            load_prompts(str(bad), 0)
    with pytest.raises(UserError, match="JSONL file, or 'builtin'"):
        load_prompts(str(tmp_path / "missing.jsonl"), 0)


def test_a_mismatched_chat_template_is_refused_naming_where(
    tmp_path: Path, tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template
    other = tmp_path / "other.jinja"
    other.write_text(tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> "))
    rule = tmp_path / "rule.txt"
    rule.write_text("# written before the run\nflips_above_floor <= 0.02\ntop1 >= 0.97\n")
    argv = ["quality", "--model", "tiny", "--prompts", str(write_prompts(tmp_path / "p.jsonl"))]
    assert main([*argv, "--accept-file", str(rule), "--candidate", f"chat-template={other}"]) == 3
    err = capsys.readouterr().err
    assert "refused: prompt 0 renders differently" in err and "first at token 1:" in err
    assert "reference: '<|im_start|>' >>> 'system" in err and "candidate: '<|im_start|>' >>> ' system" in err


def test_the_reference_against_itself_passes(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    plot = tmp_path / "report.png"
    argv = ["quality", "--model", "tiny", "--prompts", str(write_prompts(tmp_path / "p.jsonl"))]
    argv += ["--reference", SMALL_KV, "--candidate", SMALL_KV, "--max-tokens", "6", "--long-prompts", "2"]
    argv += ["--long-tokens", "24", "--accept", RULE + ",long_identical>=1", "--json", str(out), "--plot", str(plot)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["verdict"]["passed"] and report["metrics"]["top1"] == 1.0 and report["metrics"]["flips"] == 0
    assert report["metrics"]["mean_kl"] == 0.0 and report["long_outputs"]["first_divergence"] == [None, None]
    assert all(len(answer) == 6 for answer in report["answers"]["reference_a"])
    assert plot.read_bytes().startswith(b"\x89PNG")


def own_weights_engine(config: EngineConfig, scale_layer_0: float = 1.0) -> LLMEngine:
    """An engine on weights of its own (the shared model stays whole), layer 0's down_proj weight multiplied by
    `scale_layer_0`: by 2, a quantized layer whose scales are off by a factor of 2."""
    engine = LLMEngine(config)
    model, model_config = load_model(resolve_model(config.model), torch.float32)
    down_proj = model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(down_proj, torch.nn.Linear)
    with torch.no_grad():
        down_proj.weight.mul_(scale_layer_0)
    engine.runner = ModelRunner(config, model, model_config)
    return engine


def test_a_candidate_with_one_layer_doubled_fails() -> None:
    config = parse_config_spec(SMALL_KV, "-c").engine_config("tiny")
    prompts = load_prompts(BUILTIN, 0).first(6)
    rule = parse_rule(RULE)
    # The control: the same weights loaded apart pass, so what fails below is the doubled layer alone.
    control = compare(Side(config), Side(config, build=own_weights_engine), prompts, Settings(8, 0))
    assert rule.judge(control.metrics()).passed and control.top1 == 1.0
    doubled = Side(config, label="doubled", build=lambda c: own_weights_engine(c, scale_layer_0=2.0))
    comparison = compare(Side(config, label="float"), doubled, prompts, Settings(8, 0))
    verdict = rule.judge(comparison.metrics())
    assert not verdict.passed
    assert comparison.top1 < 0.9 and comparison.flips.value > 0.5 and comparison.noise_floor.value == 0
    assert comparison.flips_above_floor.low > 0  # the interval clears zero
    assert comparison.long is None


def int4_engine_with_scales_off(config: EngineConfig, layer: str = "model.layers.0.mlp.down_proj") -> LLMEngine:
    """An int4 engine on weights of its own whose one quantized layer has every group scale doubled: what a
    loader that misread a format's scales would serve."""
    engine = LLMEngine(config)
    quantization = weight_quantization(config)
    model, model_config = load_model(resolve_model(config.model), torch.float32, quantization=quantization)
    module = model.get_submodule(layer)
    assert isinstance(module, QuantizedLinear)
    float_weight = load_model(resolve_model(config.model), torch.float32)[0].get_submodule(layer).weight
    good = weight_only.quantize(float_weight, module.bits, module.group_size, symmetric=config.weight_scheme == "sym")
    bad = weight_only.QuantizedWeight(good.bits, good.group_size, good.q, good.scales * 2, good.offsets)
    parent, _, child = layer.rpartition(".")
    setattr(model.get_submodule(parent), child, QuantizedLinear.from_weight(bad, module.backend))
    engine.runner = ModelRunner(config, model, model_config)
    return engine


def test_an_int4_candidate_with_one_layers_scales_doubled_fails_against_int4() -> None:
    config = parse_config_spec(f"{SMALL_KV},weights=int4", "-c").engine_config("tiny")
    prompts = load_prompts(BUILTIN, 0).first(6)
    broken = Side(config, label="scales x2", build=int4_engine_with_scales_off)
    comparison = compare(Side(config, label="int4"), broken, prompts, Settings(8, 0))
    assert not parse_rule(RULE).judge(comparison.metrics()).passed
    assert comparison.top1 < 0.97 and comparison.flips_above_floor.low > 0
