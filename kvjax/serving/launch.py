"""``kvjax serve`` in a subprocess on a free loopback port, ready once ``GET /health`` answers 200:
what benchmarks, tests and notebooks that talk to a real server over HTTP start and stop."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``python -m kvjax serve --port PORT *args``, started and waited for.

    Args:
        args: the command line after ``serve`` (``--model`` and the rest; not ``--port``).
        timeout: seconds to wait for ``/health`` (a model's load and warm-up included).
        cwd, stdout: as ``subprocess.Popen``'s; with ``stdout`` given, stderr goes there too.
        port: the port (default: a free one).

    Raises RuntimeError if the server exits before it is ready, TimeoutError (after killing it) if
    it is not ready in ``timeout`` seconds. A context manager: leaving it stops the server (SIGTERM,
    then SIGKILL after 60 s).
    """

    def __init__(
        self,
        args: list[str],
        *,
        timeout: float = 900,
        cwd=None,
        stdout=None,
        port: int | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvjax", "serve", "--port", str(self.port), *args]
        stderr = None if stdout is None else subprocess.STDOUT
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=stdout, stderr=stderr)
        self.ready_s = self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> float:
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvjax serve exited with status {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            if time.monotonic() - start > timeout:
                self.proc.kill()
                self.proc.wait()
                raise TimeoutError(f"kvjax serve did not answer /health in {timeout:.0f} s")
            time.sleep(0.5)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, sig=signal.SIGTERM, timeout: float = 120) -> int:
        """Send ``sig`` (if still running) and return the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
