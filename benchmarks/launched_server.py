"""``specserve serve`` in a subprocess on a free port, for the load benchmarks: started, waited
for on ``/health``, stopped with SIGTERM (as a user's Ctrl-C would)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.report import BenchError
from tools import checkout


def stop_children_on_sigterm() -> None:
    """A SIGTERM to the benchmark (``timeout``, a killed job) unwinds it as an exception, so the
    servers it started are stopped by their ``with`` blocks instead of outliving it."""
    import threading

    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """``specserve serve`` in a subprocess on a free port; its output goes to ``log_path``.

    ``root``: serve that source checkout's code, run from its folder through tools/checkout.py
    (PYTHONPATH unset), whichever checkout the environment has installed: an editable install
    would otherwise mix the installed checkout's kernels/, target/ and draft/ with ``root``'s
    specserve/. By default it runs the installed code where the caller does. ``stop_timeout``:
    seconds a SIGTERM gets to end it before it is killed."""

    def __init__(self, flags: list[str], log_path: Path, timeout: float, root: Path | None = None,
                 stop_timeout: float = 30.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        runner = [sys.executable] if root is None else checkout.command(root)
        self.command = [*runner, "-m", "specserve", "serve", "--host", "127.0.0.1",
                        "--port", str(self.port), *flags]
        self.log_path, self.timeout = log_path, timeout
        self.root, self.stop_timeout = root, stop_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LaunchedServer:
        stop_children_on_sigterm()
        env = None
        if self.root is not None:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.root, env=env)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:]
                raise BenchError(f"the server exited with code {self.proc.returncode} before "
                                 f"it was ready: {tail[0] if tail else ''} (log: {self.log_path})")
            if health_ok(self.url):
                return self
            time.sleep(0.25)
        self.__exit__()
        raise BenchError(f"the server was not ready after {self.timeout:.0f} s "
                         f"(log: {self.log_path}); raise --startup-timeout")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # clean shutdown, as a user's Ctrl-C would
        try:
            self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False
