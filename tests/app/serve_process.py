"""`moedesk serve` as users start it: a subprocess on a free port of 127.0.0.1, for end-to-end tests."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx


@contextlib.contextmanager
def serve_process(args: list[str], api_key: str, startup_s: float = 90):
    """Run `python -m moedesk serve ARGS --port P` with MOEDESK_API_KEY set; yield "http://127.0.0.1:P" once
    /health answers, and stop the server afterwards (killed if it does not end within 20 s)."""
    with served(args, api_key, startup_s) as (url, _):
        yield url


@contextlib.contextmanager
def served(args: list[str], api_key: str | None, startup_s: float = 90, port: int | None = None):
    """As serve_process, yielding (url, the server's Popen) for a test that kills it on purpose. api_key None: the
    server runs without one; port None: a free one."""
    if port is None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
    env = {k: v for k, v in os.environ.items() if k != "MOEDESK_API_KEY"}
    if api_key is not None:
        env["MOEDESK_API_KEY"] = api_key
    proc = subprocess.Popen([sys.executable, "-m", "moedesk", "serve", *args, "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "moedesk serve did not come up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
