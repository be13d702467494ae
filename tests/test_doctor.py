"""`kvroute doctor`: where prompts stop sharing their prefix, through SmolLM2's real tokenizer and template."""

import json

import pytest

from kvroute.model_source import resolve_model
from kvroute.tokenizer import Tokenizer
from launch.cli import main
from sim.doctor import run_doctor
from sim.doctor_example import write_example
from sim.replay import ReplayConfig, replay
from sim.traces import read_mooncake


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.for_model(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    path = tmp_path_factory.mktemp("doctor") / "apps.jsonl"
    write_example(path, requests=60, seed=1)
    return path


def test_support_assistant_parts_at_the_request_id_on_line_2(example, tokenizer):
    report = run_doctor(example, lambda: tokenizer)
    support = next(a for a in report.apps if a.app == "support")
    head = len(tokenizer.encode("You are the support assistant for Acme.\nRequest ID:"))
    assert support.parting is not None and support.parting.line == 2
    assert head <= support.parting.token <= head + 1  # the ID's first token (or the space merged into it)
    assert support.parting.excerpt.startswith("Request ID: ")
    assert support.hit_rate < 0.02 and support.possible_hit_rate > 0.9


def test_apps_are_ranked_by_wasted_prefill_tokens(example, tokenizer, capsys):
    out = example.parent / "report.json"
    assert main(["doctor", str(example), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [a["app"] for a in data["apps"]] == ["support", "rag", "faq"]
    wasted = [a["wasted_prefill_tokens"] for a in data["apps"]]
    assert wasted[0] > wasted[1] > 0 and wasted[2] == 0
    assert data["apps"][2]["stops_sharing_at"] is None  # faq: the question is last, nothing to fix
    per_day = data["apps"][0]["wasted_prefill_tokens_per_day"]
    assert per_day == pytest.approx(wasted[0] * 86_400 / data["span_s"], rel=1e-6)
    rag = data["apps"][1]["stops_sharing_at"]  # chat messages, rendered through the chat template
    assert rag["excerpt"].startswith("Today is ") and rag["line"] > 2
    table = capsys.readouterr().out
    assert "line 2, token" in table and table.index("support") < table.index("rag") < table.index("faq")


def test_a_mooncake_trace_is_one_app_with_the_replay_ideal(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 1200, "output_length": 5, "hash_ids": [0, 1, 3]},
        {"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [0, 4]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = run_doctor(path, lambda: pytest.fail("a Mooncake trace needs no tokenizer"))
    (app,) = report.apps
    ideal = replay(read_mooncake(path), ReplayConfig(replicas=1, policies=("round_robin",))).ideal_hit_rate
    assert report.kind == "mooncake" and app.hit_rate == pytest.approx(ideal)
    assert app.cached_tokens == 1024 + 512
    assert app.parting.token == 512  # one request parts at 1,024, one at 512: a tie goes to the shallower


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "hi"}', "line 2: field 'app' must be a non-empty string"),
        ('{"app": "a", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}', "exactly one of"),
        ('{"app": "a", "messages": "hello"}', "line 2: field 'messages' must be a non-empty list"),
        ('{"app": "a", "prompt": 5}', "line 2: field 'prompt' must be a string"),
        ('{"app": "a", "prompt": "x", "timestamp": "noon"}', "line 2: field 'timestamp'"),
        ("{oops", "line 2: not valid JSON"),
    ],
)
def test_bad_lines_are_one_line_errors_naming_line_and_field(tmp_path, capsys, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"app": "a", "prompt": "fine"}\n' + line + "\n")
    assert main(["doctor", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_missing_file_is_a_clear_error(tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
