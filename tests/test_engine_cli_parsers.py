"""The flags our docs and chart pass to `vllm serve` and SGLang's `launch_server`, parsed by the engines' own
parsers (tests/engine_cli_parser.py, in a subprocess): SGLang 0.5.23's `ServerArgs.add_cli_args` and
`KVEventsConfig.from_cli` from the `--no-deps` sglang wheel that .ci/run installs; vLLM 0.33.0's `make_arg_parser`
and `EngineArgs` from the wheel's Python files and the light packages they import, which .ci/run unpacks and
installs beside them ($KVROUTE_VLLM_PACKAGE names another vllm; a test skips, naming the import that failed,
where the engine's parser does not import). Each command must parse, publish its KV events over ZMQ where
the gateway's spec reads them, serve the metrics the gateway reads load from, and use a block (page) size that
divides the gateway's."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_helm_engines import engine, engine_command, engine_flag, render

ROOT = Path(__file__).resolve().parents[1]
PARSER = ROOT / "tests" / "engine_cli_parser.py"
WHEELS = Path(os.environ.get("KVROUTE_ENGINE_WHEELS", "/opt/engine-wheels"))
SGLANG_PATH = [WHEELS / "sglang", WHEELS / "sglang-deps"]
VLLM_PATH = [Path(os.environ.get("KVROUTE_VLLM_PACKAGE", WHEELS / "vllm-0.33.0")), WHEELS / "vllm-deps"]
GATEWAY_BLOCK = 16  # the gateway's --block-size in the docs and the chart's default engine.blockSize
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def doc_commands(prefix: str) -> list[list[str]]:
    """Every command in docs/engines.md's code blocks that starts with `prefix`, as argv after it (a command
    goes on over the indented lines that follow it)."""
    text = (ROOT / "docs" / "engines.md").read_text()
    found = re.findall(rf"(?m)^{re.escape(prefix)}((?:.*\n)(?:[ \t]+.*\n)*)", text)
    return [shlex.split(body.replace("\\\n", " ")) for body in found]


def parse(engine_name: str, argvs: list[list[str]], path: list[Path]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
    done = subprocess.run(
        [sys.executable, str(PARSER), engine_name], input=json.dumps(argvs), capture_output=True, text=True,
        env=env, timeout=100,
    )  # fmt: skip
    if done.returncode == 3:
        pytest.skip(f"{engine_name}'s argument parser does not import from {path[0]}: {done.stdout.strip()[:200]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_sglang_parses_the_flags_of_our_docs_and_chart() -> None:
    if not (SGLANG_PATH[0] / "sglang" / "srt" / "server_args.py").exists():
        pytest.skip(f"the sglang wheel is not installed under {SGLANG_PATH[0]} (.ci/run installs it)")
    container = engine(render("sglang"))
    assert engine_command(container)[-1] == "sglang.launch_server"
    docs = doc_commands("python -m sglang.launch_server")
    assert docs, "docs/engines.md shows SGLang's command line"
    chart, *documented = parse("sglang", [container.args, *docs], SGLANG_PATH)
    for parsed in [chart, *documented]:
        assert "error" not in parsed, parsed
        assert parsed["enable_metrics"], f"the gateway reads an SGLang worker's load from its /metrics: {parsed}"
        assert GATEWAY_BLOCK % parsed["page_size"] == 0
        events = parsed["kv_events"]
        assert events["publisher"] == "zmq" and events["endpoint"].startswith("tcp://*:") and events["replay_endpoint"]
    assert chart["port"] == container.ports["http"]
    assert chart["page_size"] == int(engine_flag(container, "--page-size") or 0) == 16
    assert chart["kv_events"]["endpoint"] == f"tcp://*:{container.ports['kv-events']}"
    assert chart["kv_events"]["replay_endpoint"] == f"tcp://*:{container.ports['kv-replay']}"
    assert chart["kv_events"]["topic"].startswith("kv@")
    refused = parse("sglang", [["--model-path", "m", "--enable-kv-cache-events"]], SGLANG_PATH)
    assert "unrecognized arguments: --enable-kv-cache-events" in refused[0]["error"]  # vLLM's JSON key, not a flag


def test_vllm_parses_the_flags_of_our_docs_and_chart() -> None:
    container = engine(render("vllm"))
    model, *flags = container.args  # `vllm serve MODEL ...`: the model positional, given to the parser as --model
    docs = [["--model", argv[0], *argv[1:]] for argv in doc_commands("vllm serve ")]
    assert docs, "docs/engines.md shows vLLM's command line"
    chart, *documented = parse("vllm", [["--model", model, *flags], *docs], VLLM_PATH)
    for parsed in [chart, *documented]:
        assert "error" not in parsed, parsed
        assert GATEWAY_BLOCK % parsed["block_size"] == 0 and parsed["enable_prompt_tokens_details"]
        events = parsed["kv_events"]
        assert events["enable_kv_cache_events"] and events["publisher"] == "zmq" and events["replay_endpoint"]
    assert chart["port"] == container.ports["http"]
    assert chart["kv_events"]["endpoint"] == f"tcp://*:{container.ports['kv-events']}"
