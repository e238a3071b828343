"""Run a server (`jserve serve` or the mock) as a child process on a free loopback port.

The child binds port 0 and logs "listening on http://HOST:PORT"; we read the port from its log
file (which also keeps the log for a post-mortem), wait for /health to answer 200, and on exit
send SIGTERM, then SIGKILL if it has not drained within `stop_timeout` seconds.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

_LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")


def jserve_command(server_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "jserve.server.cli", "serve", "--host", "127.0.0.1",
            "--port", "0", *server_args]  # fmt: skip


def mock_command(server_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "jserve.server", "--mock", "--host", "127.0.0.1", "--port", "0",
            *server_args]  # fmt: skip


class ServerProcess:
    """`with ServerProcess(cmd, log_path) as server:` ... `server.base_url` (stopped on exit)."""

    def __init__(
        self,
        command: list[str],
        log_path: Path,
        *,
        start_timeout: float = 600.0,
        stop_timeout: float = 30.0,
        base_url: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`base_url`: where a server that does not log jserve's "listening on" line listens."""
        self.command, self.log_path = command, log_path
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.process: subprocess.Popen | None = None
        self.base_url = base_url or ""
        self.env = env
        self.startup_s = 0.0

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env,
            )  # fmt: skip
        try:
            self._wait_ready(started + self.start_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _fail(self, why: str) -> RuntimeError:
        tail = self.log_path.read_text(errors="replace")[-2000:]
        return RuntimeError(f"server {' '.join(self.command)} {why}; log tail:\n{tail}")

    def _wait_ready(self, deadline: float) -> None:
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._fail(f"exited with code {self.process.returncode} before ready")
            if not self.base_url:
                found = _LISTENING.search(self.log_path.read_text(errors="replace"))
                if found:
                    self.base_url = f"http://{found[1]}:{found[2]}"
            elif self._healthy():
                return
            time.sleep(0.2)
        raise self._fail(f"was not ready within {self.start_timeout:g} s")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
