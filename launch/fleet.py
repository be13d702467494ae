"""The fleet launcher: child processes of a local fleet, for `kvroute up`, `kvroute bench --compare` and
`--faults`, and the tests that run real workers and gateways.

A `Fleet` starts children (`spawn`) and ends every one it started, by its id (`stop`, or leaving the `with`
block): one SIGTERM to each child (it drains and stops its own children; a second signal would cut the drain
short), then SIGKILL to the process group of any still alive after the grace period, then reaps them. Each
child leads a process group of its own, so the SIGKILL takes a child's own children (a gateway's
`--processes`) with it, and a Ctrl-C at a terminal reaches the launcher only, which then stops the fleet.
A child spawned by the main thread also asks the kernel for SIGTERM should the launcher die without cleaning
up (PR_SET_PDEATHSIG, Linux), so no worker outlives it; the kernel sends that signal when the *thread* that
spawned the child ends, so a child spawned by another thread (`asyncio.to_thread`) goes without.

A child's output goes to `<log_dir>/<name>.log` when the fleet has a `log_dir` (the launcher's own errors
then end with the tail of the log), else to the launcher's own stdout and stderr. `wait_until` polls a
readiness check and fails as soon as any child exits. `http_ok`, `grpc_serving` and `routable` are the
checks for a worker or gateway; `kvroute_argv` runs this tree's command line in a child.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

STOP_GRACE_S = 15.0
# What `kvroute up` and the bench's fleets give every kvroute worker before their own extra flags (which may undo
# it): priority scheduling, so that a request's priority holds inside its worker too (docs/worker.md, "Scheduling
# policy": the overload benchmark's interactive band).
FLEET_WORKER_FLAGS = ("--scheduling-policy", "priority")
POLL_S = 0.2
_SETPRIV = shutil.which("setpriv") if sys.platform == "linux" else None
_HANDED_OUT: set[int] = set()
# The checks reach loopback servers: never through a proxy that the environment names.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` (the OS's pick) and never handed out before by this process: the OS
    may offer a port again as soon as its probe socket closes, before the child it was meant for has bound it,
    and two children on one port make a fleet with a duplicate address. Another process can still take it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(1000):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free port on {host} that this process has not handed out already")


def kvroute_argv(*args: str) -> list[str]:
    """`kvroute ARGS` as a child's command line: this Python, this tree's command line."""
    return [sys.executable, "-m", "launch.cli", *args]


class LaunchError(RuntimeError):
    """A child that exited, or a fleet that was not ready in time; with a log, the message ends with its tail."""


@dataclass
class Child:
    """One process of a fleet, started again by `start()` with the same command line (so the same ports)."""

    name: str
    argv: list[str]
    env: Mapping[str, str] | None = None  # None: the launcher's own environment
    log: Path | None = None  # None: the launcher's stdout and stderr
    process: subprocess.Popen | None = None

    def start(self) -> None:
        env = None if self.env is None else dict(self.env)
        if self.log is None:
            out: int | None = None
        else:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            out = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self.process = subprocess.Popen(
                _dying_with_this_thread(self.argv), env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=None if out is None else subprocess.STDOUT, process_group=0,
            )  # fmt: skip
        finally:
            if out is not None:
                os.close(out)

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal(self, sig: signal.Signals, wait_s: float = STOP_GRACE_S) -> int | None:
        """Send `sig` to the child, wait up to `wait_s` for it to exit, then SIGKILL its process group (its
        own children too); returns its exit status (None if it was never started)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self._reap(wait_s)

    def _reap(self, wait_s: float) -> int:
        assert self.process is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=wait_s)
        _signal_group(self.process.pid, signal.SIGKILL)  # the group's stragglers too
        return self.process.wait()

    def output(self) -> str:
        """What the child has written to its log so far ("" without a log)."""
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 15) -> str:
        return "\n".join("    " + line for line in self.output().splitlines()[-lines:])

    def wait_for_line(self, text: str, timeout_s: float) -> str:
        """The first line of the child's log that contains `text`, once it is written; LaunchError when the
        child exits first or after `timeout_s`."""
        found: list[str] = []

        def written() -> bool:
            found.extend(line for line in self.output().splitlines() if text in line)
            return bool(found)

        wait_until([self], written, f"{self.name}'s line {text!r}", timeout_s)
        return found[0]


class Fleet:
    """Children started together and stopped together; a context manager that stops them on the way out."""

    def __init__(self, log_dir: Path | None = None, env: Mapping[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = env
        self.children: list[Child] = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None, start: bool = True) -> Child:
        """A child named `name` (its log: `<log_dir>/<name>.log`), with `env` (default: the fleet's), started
        unless `start` is False (the caller starts it later, e.g. a router once its workers are up)."""
        log = None if self.log_dir is None else self.log_dir / f"{name.replace(':', '-').replace(' ', '-')}.log"
        child = Child(name, argv, self.env if env is None else env, log)
        self.children.append(child)
        if start:
            child.start()
        return child

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def exited(self) -> str | None:
        """`NAME exited with status N` for a started child that has exited, if any."""
        dead = _exited(self.children)
        return None if dead is None else f"{dead.name} exited with status {dead.returncode}"

    def wait_until(
        self, ready: Callable[[], bool], what: str, timeout_s: float, interrupted: Callable[[], bool] | None = None
    ) -> bool:
        """Poll `ready` until it holds (True), or until `interrupted()` does (False); LaunchError as soon as a
        child exits, or after `timeout_s`."""
        return wait_until(self.children, ready, what, timeout_s, interrupted)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to every running child, once; SIGKILL to the group of each still alive after `grace_s` in
        all; returns once every child is reaped."""
        started = [c for c in self.children if c.process is not None]
        for child in started:
            if child.process is not None and child.running:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in started:
            child._reap(max(0.0, deadline - time.monotonic()))


def wait_until(
    children: list[Child],
    ready: Callable[[], bool],
    what: str,
    timeout_s: float,
    interrupted: Callable[[], bool] | None = None,
) -> bool:
    """`Fleet.wait_until` over `children`: the message of a child's exit is `NAME exited with status N`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if interrupted is not None and interrupted():
            return False
        if ready():
            return True
        dead = _exited(children)
        if dead is not None:
            raise LaunchError(_with_tail(f"{dead.name} exited with status {dead.returncode}", dead))
        if time.monotonic() > deadline:
            logged = next((c for c in children if c.log is not None and c.running), None)
            raise LaunchError(_with_tail(f"{what} was not ready after {timeout_s:g} s", logged))
        time.sleep(POLL_S)


def _exited(children: list[Child]) -> Child | None:
    return next((c for c in children if c.process is not None and c.process.poll() is not None), None)


def _with_tail(message: str, child: Child | None) -> str:
    tail = "" if child is None else child.tail()
    return f"{message}\n{tail}" if tail else message


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """`url` answers 200."""
    try:
        with _OPENER.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def routable(url: str) -> int:
    """How many workers the gateway at `url` can route to now (its /ready body), 0 when it does not answer."""
    try:
        with _OPENER.open(f"{url}/ready", timeout=1.0) as response:
            return int(json.loads(response.read())["workers"])
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return 0


def grpc_serving(address: str) -> bool:
    """The worker's gRPC health says SERVING (it has loaded and warmed up its model)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _dying_with_this_thread(argv: list[str]) -> list[str]:
    """`argv` under `setpriv --pdeathsig TERM` where util-linux has it: the child gets SIGTERM when the thread that
    started it dies, so a killed launcher leaves no fleet behind. Not a `preexec_fn` calling prctl: that makes
    Popen fork() rather than vfork(), and a fork while gRPC's threads poll (a test process with live channels)
    crashes the child before exec (SIGSEGV or SIGABRT in gRPC's fork handlers, 9% of starts when measured).
    Elsewhere, and from other threads (the signal follows the thread, not the process), `stop` is the cleanup."""
    if _SETPRIV is None or threading.current_thread() is not threading.main_thread():
        return argv
    return [_SETPRIV, "--pdeathsig", "TERM", "--", *argv]


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
