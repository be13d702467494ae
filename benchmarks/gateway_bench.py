"""What the gateway costs: its added latency, its throughput, and its routing decision, against the same
workers called directly and against SGLang's Rust router (smg) over the same workers, in one run.

    python -m benchmarks.gateway_bench --json OUT [--workers 2] [--requests 300] [--duration 8] [--profile FILE]
        [--streams 100] [--stream-tokens 200] [--stream-rounds 3] [--baseline-tree DIR]

Set-up: `--workers` sim workers (`kvroute worker --model sim --http-port`, sim costs 0, so the worker is
not the bottleneck), our gateway over their gRPC ports (`kvroute gateway`, kv_aware), and smg over their
HTTP ports (`smg launch --policy cache_aware`). Every process is a child in one process group, stopped at
the end.

1. Latency, one request at a time, the targets interleaved request by request, their order rotated each
   request (the machine is shared: drift hits all alike): a chat completion (non-streaming, 4 tokens) sent
   - to worker 0's own HTTP port (`worker_http`: the same front door and tokenizer, in the worker's process),
   - through our gateway (`gateway_http`: HTTP -> route -> gRPC -> worker),
   - through smg (`smg_http`: HTTP -> route -> HTTP -> worker's front door),
   and the same prompt's token ids to worker 0 over gRPC (`worker_grpc`, the floor).
   Added latency = a router's percentile less worker_http's (both sides do the HTTP, JSON and tokenizer
   work once, the router adds its hop and decision); ours is also given against worker_grpc.
2. Throughput: `--concurrency` keep-alive connections for `--duration` seconds through the gateway (and,
   for scale, to a worker's HTTP port and through smg), in slices of about a second, the targets in turn.
   Client, gateway and workers share this machine's cores, so the figure that holds is the server
   process's CPU time per request (its process CPU clock); `--profile` runs the gateway under cProfile (timed in
   process CPU time, so waiting costs nothing) and writes its top functions, which name what bounds it.
3. Streams: `--streams` concurrent streamed chat completions of `--stream-tokens` tokens each
   (`ignore_eos`), `--stream-rounds` rounds, the targets in turn: the server process's CPU time per
   streamed token (the tokens counted from each stream's usage chunk).
With `--baseline-tree DIR` a second gateway runs the same command from DIR's code (`baseline_http`), so a
change is measured against the previous state in the same run.
4. The routing decision for a 4,096-token chat prompt: template + tokenize, block hashes, and the pick
   over an 8-worker view whose index holds half of the prompt, medians of 200 runs of this process's CPU
   time, in this process (before the fleet starts); and the floor, `tokenizers`' own encode of the same
   rendered text.
The client is a minimal HTTP/1.1 keep-alive client (loadtest's own), so that it costs the same for every
target and little.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks.cpu_time import median_cpu_us
from launch.fleet import Fleet, free_port, kvroute_argv

SYSTEM = "You are a concise assistant for a bicycle shop. Answer in one short sentence. " * 6
MAX_TOKENS = 4


# -- a minimal HTTP/1.1 client ---------------------------------------------------------------------------------


class HttpConnection:
    """One keep-alive connection; `post` returns (status, body). Content-Length and chunked bodies."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        assert self.reader is not None
        status_and_headers = await self.reader.readuntil(b"\r\n\r\n")
        lines = status_and_headers.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        if "content-length" in headers:
            payload = await self.reader.readexactly(int(headers["content-length"]))
        else:  # chunked
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                parts.append(await self.reader.readexactly(size + 2))
                if size == 0:
                    break
            payload = b"".join(p[:-2] for p in parts)
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, payload

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def chat_body(i: int) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: do you fix brakes?"}]
    return json.dumps({"model": "sim", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()


# -- the fleet -------------------------------------------------------------------------------------------------------


def wait_ok(request: str | urllib.request.Request, timeout: float, fleet: Fleet, interval: float = 0.2) -> None:
    """Poll `request` until it answers 200; RuntimeError when a process of the fleet exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = fleet.exited()
        if dead is not None:
            raise RuntimeError(dead)
        try:
            with urllib.request.urlopen(request, timeout=2.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(interval)
    url = request if isinstance(request, str) else request.full_url
    raise RuntimeError(f"{url} did not answer 200 within {timeout:g} s")


def start_fleet(
    num_workers: int, profile: str | None, with_smg: bool, baseline_tree: str | None = None
) -> tuple[Fleet, dict[str, Any]]:
    fleet = Fleet()
    grpc_ports = [free_port() for _ in range(num_workers)]
    http_ports = [free_port() for _ in range(num_workers)]
    for i, (grpc_port, http_port) in enumerate(zip(grpc_ports, http_ports, strict=True)):
        fleet.spawn(
            f"worker-{i}",
            kvroute_argv(
                "worker", "--model", "sim", "--port", str(grpc_port), "--http-port", str(http_port),
                "--worker-id", f"worker-{i}", "--sim-prefill-us-per-token", "0", "--sim-decode-ms-per-step", "0",
                "--num-kv-blocks", "4096",
            ),
        )  # fmt: skip
    gateway_port = free_port()
    gateway_argv = kvroute_argv(
        "gateway", "--model", "sim", "--host", "127.0.0.1", "--http-port", str(gateway_port), "--grpc-port", "0",
        "--workers", ",".join(f"127.0.0.1:{p}" for p in grpc_ports), "--log-level", "warning", "--metrics-port", "0",
    )  # fmt: skip
    if profile:  # serving only, under cProfile (not the start-up's tokenizer load)
        code = "import sys; from benchmarks.gateway_bench import profiled_gateway; profiled_gateway(sys.argv[1:])"
        gateway_argv = [sys.executable, "-c", code, profile, *gateway_argv[4:]]
    fleet.spawn("gateway", gateway_argv)
    ports = {"worker_grpc": grpc_ports[0], "worker_http": http_ports[0], "gateway_http": gateway_port}
    if baseline_tree:  # the same gateway command, run from another checkout's code
        ports["baseline_http"] = free_port()
        argv = kvroute_argv("gateway", *gateway_argv[4:])  # never under the profiler
        argv[argv.index("--http-port") + 1] = str(ports["baseline_http"])
        # PYTHONSAFEPATH: `-m` would put the working directory (this tree) on sys.path before PYTHONPATH.
        env = {**os.environ, "PYTHONPATH": str(Path(baseline_tree).resolve()), "PYTHONSAFEPATH": "1"}
        fleet.spawn("baseline", argv, env=env)
    for port in (*http_ports, *(p for name, p in ports.items() if name in ("gateway_http", "baseline_http"))):
        wait_ok(f"http://127.0.0.1:{port}/ready", 300, fleet)
    smg = shutil.which("smg", path=str(Path(sys.executable).parent)) if with_smg else None
    if smg:
        smg_port = free_port()
        fleet.spawn(
            "smg",
            [smg, "launch", "--host", "127.0.0.1", "--port", str(smg_port), "--policy", "cache_aware",
             "--log-level", "warn", "--worker-urls", *(f"http://127.0.0.1:{p}" for p in http_ports)],
        )  # fmt: skip
        ports["smg_http"] = smg_port
        wait_smg(smg_port, fleet)
    return fleet, ports


def wait_smg(port: int, fleet: Fleet) -> None:
    """smg answers once it has registered the workers: poll with a real request."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    wait_ok(urllib.request.Request(url, chat_body(0), {"content-type": "application/json"}), 60, fleet, 0.3)


# -- 1. latency --------------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure_latency(ports: dict[str, int], requests: int, warmup: int) -> dict[str, dict[str, float]]:
    import grpc

    from kvroute.model_source import resolve_model
    from kvroute.tokenizer import Tokenizer
    from proto import worker_pb2, worker_pb2_grpc

    tokenizer = Tokenizer.for_model(resolve_model("sim"))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{ports['worker_grpc']}")
    stub = worker_pb2_grpc.WorkerStub(channel)
    connections = {name: HttpConnection("127.0.0.1", port) for name, port in ports.items() if name.endswith("_http")}

    def grpc_call(i: int) -> Callable[[], Awaitable[None]]:
        body = json.loads(chat_body(i))
        ids = tokenizer.encode_chat(body["messages"])
        message = worker_pb2.GenerateRequest(
            prompt_token_ids=ids, sampling=worker_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        )

        async def call() -> None:
            async for _ in stub.Generate(message):
                pass

        return call

    async def http_call(name: str, i: int) -> None:
        status, payload = await connections[name].post("/v1/chat/completions", chat_body(i))
        if status != 200:
            raise RuntimeError(f"{name}: HTTP {status}: {payload[:200]!r}")

    samples: dict[str, list[float]] = {name: [] for name in ["worker_grpc", *connections]}
    names = list(samples)
    for i in range(warmup + requests):
        grpc_request = grpc_call(i)
        turn = i % len(names)
        for name in names[turn:] + names[:turn]:  # each target first as often: no one always follows another
            start = time.perf_counter()
            if name == "worker_grpc":
                await grpc_request()
            else:
                await http_call(name, i)
            if i >= warmup:
                samples[name].append(time.perf_counter() - start)
    for connection in connections.values():
        await connection.close()
    await channel.close()
    return {
        name: {
            "p50_ms": percentile(v, 0.5) * 1e3,
            "p99_ms": percentile(v, 0.99) * 1e3,
            "mean_ms": statistics.fmean(v) * 1e3,
        }
        for name, v in samples.items()
    }


# -- 2. throughput ------------------------------------------------------------------------------------------


_libc = ctypes.CDLL(None, use_errno=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (ended ones included), from its process CPU clock
    (clock_getcpuclockid(3)): nanoseconds, where /proc's stat counts 10 ms ticks, which a stream phase of
    0.2-0.5 CPU-s would read 2-5% off. /proc's ticks if the clock cannot be had."""
    clock = ctypes.c_int()
    if _libc.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0:
        return time.clock_gettime(clock.value)
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds by thread name (Linux /proc; threads of one name summed)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


async def measure_throughput(port: int, concurrency: int, duration: float, pid: int | None) -> dict[str, float]:
    """Closed loop for `duration` s: the requests done, the errors, the seconds and (with `pid`) that
    process's CPU seconds over them (what it would need of a core of its own: the noise-free figure on a
    shared machine)."""
    cpu_before = cpu_seconds(pid) if pid else 0.0
    threads_before = thread_cpu_seconds(pid) if pid else {}
    done = 0
    errors = 0
    stop_at = time.perf_counter() + duration

    async def client(k: int) -> None:
        nonlocal done, errors
        connection = HttpConnection("127.0.0.1", port)
        i = k * 1_000_000 + int(time.monotonic() * 1000) % 1_000_000
        while time.perf_counter() < stop_at:
            status, _ = await connection.post("/v1/chat/completions", chat_body(i))
            i += 1
            if status == 200:
                done += 1
            else:
                errors += 1
        await connection.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(concurrency)))
    elapsed = time.perf_counter() - start
    cpu = cpu_seconds(pid) - cpu_before if pid else 0.0
    threads = thread_cpu_seconds(pid) if pid else {}
    by_thread = {f"thread_cpu_s:{name}": t - threads_before.get(name, 0.0) for name, t in threads.items()}
    return {"requests": done, "errors": errors, "seconds": elapsed, "server_cpu_s": cpu, **by_thread}


def interleaved(names: list[str], slices: int, measure: Callable[[str, int], dict[str, float]]) -> dict[str, Any]:
    """`measure(name, k)` for slice k = 0..slices-1 of every target in turn (so the machine's drift hits all
    alike), its figures summed per target."""
    totals: dict[str, dict[str, float]] = {name: {} for name in names}
    for k in range(slices):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            for key, value in measure(name, k).items():
                totals[name][key] = totals[name].get(key, 0) + value
    return totals


def throughput_figures(raw: dict[str, float]) -> dict[str, float]:
    result = {**raw, "requests_per_s": raw["requests"] / raw["seconds"]}
    if raw["server_cpu_s"] and raw["requests"]:
        result["server_cpu_ms_per_request"] = raw["server_cpu_s"] * 1e3 / raw["requests"]
        result["requests_per_s_per_core"] = raw["requests"] / raw["server_cpu_s"]
    return result


# -- 3. streams ---------------------------------------------------------------------------------------------


def stream_body(i: int, tokens: int) -> bytes:
    body = json.loads(chat_body(i))
    body.update(max_tokens=tokens, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    return json.dumps(body).encode()


def completion_tokens(sse_body: bytes) -> int:
    """The `completion_tokens` of a stream's usage chunk (0 when it has none)."""
    for line in reversed(sse_body.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage":{' in line:
            return int(json.loads(line[6:])["usage"]["completion_tokens"])
    return 0


async def measure_streams(port: int, streams: int, tokens: int, pid: int | None) -> dict[str, float]:
    """`streams` concurrent streams of `tokens` tokens: the tokens delivered, the streams cut short, the
    seconds and (with `pid`) that process's CPU seconds over them (each stream's request cost included)."""
    cpu_before = cpu_seconds(pid) if pid else 0.0
    delivered = 0
    short = 0

    async def one(k: int) -> None:
        nonlocal delivered, short
        connection = HttpConnection("127.0.0.1", port)
        status, payload = await connection.post("/v1/chat/completions", stream_body(k, tokens))
        await connection.close()
        got = completion_tokens(payload) if status == 200 else 0
        delivered += got
        short += got != tokens

    start = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(streams)))
    elapsed = time.perf_counter() - start
    cpu = cpu_seconds(pid) - cpu_before if pid else 0.0
    return {"tokens": delivered, "short_streams": short, "seconds": elapsed, "server_cpu_s": cpu}


def stream_figures(raw: dict[str, float]) -> dict[str, float]:
    result = {**raw, "tokens_per_s": raw["tokens"] / raw["seconds"]}
    if raw["server_cpu_s"] and raw["tokens"]:
        result["server_cpu_us_per_token"] = raw["server_cpu_s"] * 1e6 / raw["tokens"]
    return result


# -- 4. the routing decision --------------------------------------------------------------------------------


def measure_routing_decision(prompt_tokens: int = 4096, replicas: int = 8, repeats: int = 200) -> dict[str, float]:
    from gateway.routing.fleet_view import FleetView
    from gateway.routing.router import RouteRequest, make_policy
    from kvroute.hashing import block_hashes
    from kvroute.model_source import resolve_model
    from kvroute.tokenizer import Tokenizer

    source = resolve_model("sim")
    tokenizer = Tokenizer.for_model(source)
    words = "The quick brown fox jumps over the lazy dog near the river bank. "
    system = words * (prompt_tokens // 14)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise."}]
    while len(ids := tokenizer.encode_chat(messages)) > prompt_tokens:
        system = system[: -len(words)]
        messages[0]["content"] = system
    hashes = block_hashes(ids, model_id=source.model_id)
    view = FleetView.empty([f"w{i}" for i in range(replicas)])
    view.kv_index.add("w3", hashes[: len(hashes) // 2])
    policy = make_policy("kv_aware")

    def median_us(fn: Callable[[], object]) -> float:
        return median_cpu_us(fn, repeats)

    template_tokenize = median_us(lambda: tokenizer.encode_chat(messages))
    # The floor: the `tokenizers` library's own encode of the same rendered text (special tokens parsed from
    # it, which the gateway must never do with client text), and of the text alone.
    from kvroute.chat_template import render_chat_template

    template = tokenizer.chat_template
    assert template is not None  # SmolLM2's GGUF carries one
    rendered = render_chat_template(template, messages, add_generation_prompt=True)
    floor_ids = tokenizer.backend.encode(rendered, add_special_tokens=False).ids
    library_encode = median_us(lambda: tokenizer.backend.encode(rendered, add_special_tokens=False))
    library_encode_fast = median_us(lambda: tokenizer.backend.encode_batch_fast([rendered], add_special_tokens=False))
    render = median_us(lambda: render_chat_template(template, messages, add_generation_prompt=True))
    hashing = median_us(lambda: block_hashes(ids, model_id=source.model_id))
    request = RouteRequest("r", hashes, len(ids))
    pick = median_us(lambda: policy.observe(request, policy.pick(request, view)))

    def whole(scope: str | None) -> None:
        prompt = tokenizer.encode_chat(messages, cache_scope=scope)
        route = RouteRequest("r", block_hashes(prompt, model_id=source.model_id), len(prompt))
        policy.observe(route, policy.pick(route, view))

    whole("tenant")  # the system prompt is now remembered for this scope (a tenant's repeated system prompt)
    return {
        "prompt_tokens": len(ids),
        "replicas": replicas,
        "template_and_tokenize_us": template_tokenize,
        "floor_tokenizers_encode_us": library_encode,
        "floor_tokenizers_encode_batch_fast_us": library_encode_fast,
        "floor_ids_equal": floor_ids == ids,
        "template_render_us": render,
        "block_hashes_us": hashing,
        "pick_us": pick,
        "total_us": median_us(lambda: whole(None)),
        "total_system_prompt_seen_us": median_us(lambda: whole("tenant")),
    }


def profiled_gateway(argv: list[str]) -> None:
    """`kvroute gateway ARGS` with its serving (not its start-up) under cProfile, written to argv[0]."""
    import cProfile

    import uvloop

    from gateway.cli_gateway import build_gateway, serve
    from kvroute.heap import freeze_start_up_heap
    from launch.cli import build_parser

    out, gateway_args = argv[0], ["gateway", *argv[1:]]
    args = build_parser(gateway_args).parse_args(gateway_args)
    gateway = build_gateway(args)
    freeze_start_up_heap()  # as `kvroute gateway` does, before serving
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    try:
        uvloop.run(serve(gateway, args))
    finally:
        profiler.disable()
        profiler.dump_stats(out)


# -- the run ------------------------------------------------------------------------------------------------------


# Where a function's own time goes: the first stage whose pattern its file name contains; a C function
# (file "~") goes where its caller goes.
STAGES = (
    ("event loop (uvloop: sockets, callbacks)", ("asyncio/", "uvloop/")),
    ("HTTP server (httptools, our protocol: limits, request cycle, routes)",
     ("gateway/frontdoors/http_protocol.py", "gateway/frontdoors/http_routes.py", "http_listener.py")),
    ("front door: parse, validate, render (pydantic, orjson)",
     ("gateway/frontdoors/http_server.py", "openai_protocol.py", "pydantic", "gateway/request.py")),
    ("chat template + tokenize, detokenize", ("kvroute/tokenizer.py", "chat_template.py", "jinja2", "<template>",
                                               "stop_strings.py")),
    ("block hashes", ("kvroute/hashing.py",)),
    ("routing pick + fleet view", ("gateway/routing/router.py", "gateway/fleet", "kv_index.py", "common_prefix.py",
                                   "embedded_fleet.py", "gateway/forwarding/retry.py", "hash_ring.py")),
    ("gRPC call and stream (grpc.aio, protobuf)", ("grpc/", "gateway/forwarding/backends.py", "worker_client.py",
                                                   "protobuf", "_pb2")),
    ("metrics (prometheus_client)", ("prometheus_client", "gateway/metrics.py")),
    ("spans (OpenTelemetry)", ("opentelemetry", "gateway/tracing.py")),
    ("request path bookkeeping (auth, limits, Generation)", ("gateway/request_path.py", "gateway/admission/auth.py",
                                                            "gateway/admission/limits.py", "uuid.py", "sampling")),
    ("prompt pool handoff (threads)", ("concurrent/futures", "threading.py", "_weakrefset.py")),
)  # fmt: skip


def profile_stages(path: str) -> dict[str, float]:
    """Each stage's share of the profile's CPU time (STAGES; "other" for the rest, start-up imports included)."""
    import pstats

    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]

    def stage_of(func: tuple[str, int, str], depth: int = 0) -> str:
        filename = func[0]
        if filename != "~":
            return next((name for name, patterns in STAGES if any(p in filename for p in patterns)), "other")
        return "other" if depth > 8 else ""  # a C function: its callers decide

    totals: dict[str, float] = {}

    def add(func: tuple[str, int, str], seconds: float, depth: int = 0) -> None:
        stage = stage_of(func, depth)
        if stage:
            totals[stage] = totals.get(stage, 0.0) + seconds
            return
        callers = stats[func][4]
        spent = sum(c[2] for c in callers.values())
        if not callers or spent <= 0:
            totals["other"] = totals.get("other", 0.0) + seconds
            return
        for caller, c in callers.items():
            add(caller, seconds * c[2] / spent, depth + 1)

    for func, (_, _, tottime, _, _) in stats.items():
        add(func, tottime)
    whole = sum(totals.values()) or 1.0
    return {name: t / whole for name, t in sorted(totals.items(), key=lambda kv: -kv[1])}


def profile_top(path: str, limit: int = 25) -> str:
    import io
    import pstats

    out = io.StringIO()
    out.write("share of the gateway's CPU time by stage:\n")
    for name, share in profile_stages(path).items():
        out.write(f"  {share * 100:5.1f}%  {name}\n")
    pstats.Stats(path, stream=out).sort_stats("tottime").print_stats(limit)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gateway_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=300, help="latency samples per target")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per throughput target")
    parser.add_argument("--streams", type=int, default=100, help="concurrent streams (0: no stream phase)")
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--stream-rounds", type=int, default=3)
    parser.add_argument("--no-smg", action="store_true", help="leave smg out")
    parser.add_argument(
        "--baseline-tree", default=None, help="also run the gateway from this checkout (`baseline_http`), same run"
    )
    parser.add_argument(
        "--profile", default=None, help="write the gateway's cProfile top functions here (and FILE.pstats)"
    )
    args = parser.parse_args(argv)

    import uvloop

    results: dict[str, Any] = {"machine": f"{os.cpu_count()} CPUs, shared with the workers and the client"}
    results["routing_decision"] = measure_routing_decision()
    profile_raw = tempfile.mktemp(suffix=".prof") if args.profile else None
    fleet, ports = start_fleet(args.workers, profile_raw, with_smg=not args.no_smg, baseline_tree=args.baseline_tree)
    try:
        latency = uvloop.run(measure_latency(ports, args.requests, args.warmup))
        results["latency"] = latency
        base = latency["worker_http"]
        results["added_latency_ms"] = {
            router: {
                "p50": latency[router]["p50_ms"] - base["p50_ms"],
                "p99": latency[router]["p99_ms"] - base["p99_ms"],
            }
            for router in ("gateway_http", "baseline_http", "smg_http")
            if router in latency
        }
        results["added_latency_ms"]["gateway_http_vs_worker_grpc"] = {
            "p50": latency["gateway_http"]["p50_ms"] - latency["worker_grpc"]["p50_ms"],
            "p99": latency["gateway_http"]["p99_ms"] - latency["worker_grpc"]["p99_ms"],
        }
        if "smg_http" in latency:
            ours, theirs = (
                results["added_latency_ms"]["gateway_http"]["p50"],
                results["added_latency_ms"]["smg_http"]["p50"],
            )
            results["overhead_ratio_p50_gateway_over_smg"] = ours / theirs if theirs > 0 else float("inf")
        pids = {"gateway_http": "gateway", "baseline_http": "baseline", "worker_http": "worker-0", "smg_http": "smg"}
        by_name = {child.name: child.pid for child in fleet.children}
        targets: list[str] = [
            name for name in ("gateway_http", "baseline_http", "worker_http", "smg_http") if name in ports
        ]
        slices = max(1, round(args.duration))

        def throughput_slice(name: str, k: int) -> dict[str, float]:
            pid = by_name[pids[name]]
            return uvloop.run(measure_throughput(ports[name], args.concurrency, args.duration / slices, pid))

        raw = interleaved(targets, slices, throughput_slice)
        results["throughput"] = {name: throughput_figures(raw[name]) for name in targets}
        if args.streams:

            def stream_round(name: str, k: int) -> dict[str, float]:
                pid = by_name[pids[name]]
                return uvloop.run(measure_streams(ports[name], args.streams, args.stream_tokens, pid))

            raw = interleaved([n for n in targets if n != "worker_http"], args.stream_rounds, stream_round)
            results["streams"] = {name: stream_figures(figures) for name, figures in raw.items()}
    finally:
        if profile_raw:  # SIGINT: the gateway drains and returns, so cProfile writes its file
            fleet.child("gateway").signal(signal.SIGINT, wait_s=30)
        fleet.stop()
    if profile_raw and Path(profile_raw).is_file():
        Path(args.profile).write_text(profile_top(profile_raw))
        shutil.move(profile_raw, f"{args.profile}.pstats")  # the whole profile, for pstats
        results["profile"] = args.profile
    results["cpu_ratios"] = {other: cpu_ratios(results, other) for other in ("smg_http", "baseline_http")}
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(format_results(results))
    return 0


def cpu_ratios(r: dict[str, Any], other: str) -> dict[str, float]:
    """Our gateway's CPU per request and per streamed token over `other`'s, from the same run."""
    ratios = {}
    for phase, key, name in (
        ("throughput", "server_cpu_ms_per_request", "request"),
        ("streams", "server_cpu_us_per_token", "token"),
    ):
        figures = r.get(phase, {})
        if key in figures.get(other, {}) and key in figures.get("gateway_http", {}):
            ratios[name] = figures["gateway_http"][key] / figures[other][key]
    return ratios


def format_results(r: dict[str, Any]) -> str:
    lines = [f"gateway_bench ({r['machine']})", "latency, one at a time (ms):"]
    for name, v in r["latency"].items():
        lines.append(f"  {name:<13} p50 {v['p50_ms']:7.2f}  p99 {v['p99_ms']:7.2f}")
    lines.append("added latency over the worker's own HTTP port (ms):")
    for name, v in r["added_latency_ms"].items():
        lines.append(f"  {name:<27} p50 {v['p50']:+7.2f}  p99 {v['p99']:+7.2f}")
    if "overhead_ratio_p50_gateway_over_smg" in r:
        lines.append(f"  our p50 overhead / smg's: {r['overhead_ratio_p50_gateway_over_smg']:.2f}x")
    lines.append(
        "throughput (requests/s, closed loop; the server process's CPU per request, and so its rate on a core):"
    )
    for name, v in r["throughput"].items():
        lines.append(
            f"  {name:<13} {v['requests_per_s']:7.0f}  ({v['errors']} errors)  "
            f"{v.get('server_cpu_ms_per_request', float('nan')):.2f} CPU-ms/request -> "
            f"{v.get('requests_per_s_per_core', float('nan')):.0f}/s per core"
        )
    if "streams" in r:
        lines.append("streams (concurrent streamed chat completions; the server process's CPU per streamed token):")
        for name, v in r["streams"].items():
            lines.append(
                f"  {name:<13} {v['tokens_per_s']:7.0f} tokens/s  ({v['short_streams']} short streams)  "
                f"{v.get('server_cpu_us_per_token', float('nan')):.1f} CPU-µs/token"
            )
    for other in ("smg_http", "baseline_http"):
        ratios = cpu_ratios(r, other)
        if ratios:
            lines.append(f"our CPU / {other}'s: " + ", ".join(f"per {k} {v:.2f}x" for k, v in ratios.items()))
    d = r["routing_decision"]
    lines.append(
        f"routing decision, {d['prompt_tokens']}-token chat prompt, {d['replicas']} replicas (µs, median): "
        f"template+tokenize {d['template_and_tokenize_us']:.0f} (the floor, `tokenizers`' encode of the "
        f"rendered text: {d['floor_tokenizers_encode_us']:.0f}, encode_batch_fast "
        f"{d['floor_tokenizers_encode_batch_fast_us']:.0f}, same ids: {d['floor_ids_equal']}; the template alone "
        f"{d['template_render_us']:.0f}), hashes {d['block_hashes_us']:.0f}, "
        f"pick {d['pick_us']:.0f}, total {d['total_us']:.0f}; its system prompt seen before: "
        f"{d['total_system_prompt_seen_us']:.0f}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
