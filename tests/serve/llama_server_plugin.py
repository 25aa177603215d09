"""A pytest plugin that lets llama.cpp's server tests (tools/server/tests in a llama.cpp tree) drive `moedesk serve`
in their external mode (DEBUG_EXTERNAL: they send requests to a server already running on PORT and start none).

Two adaptations, nothing else: `wget` (which their utils import to fetch models, unused here) is stood in for when it
is not installed, and a request that names no model names the served one, since OpenAI's API, which moedesk follows,
requires `model` where llama-server ignores it. tests/serve/llama_server_suite.py runs them with it."""
from __future__ import annotations

import os
import sys
import types

SERVED_MODEL = os.environ.get("MOEDESK_SUITE_MODEL", "demo")

if "wget" not in sys.modules:
    try:
        import wget  # noqa: F401
    except ImportError:
        def _no_download(url, out=None):
            raise RuntimeError(f"moedesk's adapter downloads nothing ({url}): the server is already running")

        sys.modules["wget"] = types.SimpleNamespace(download=_no_download)


def pytest_configure(config):
    import utils  # their tests/utils.py, on the path from their own rootdir

    def with_model(method):
        def call(self, method_name, path, data=None, *args, **kwargs):
            if isinstance(data, dict) and data.get("model") is None and path.rstrip("/").endswith(
                    ("completions", "responses")):
                data = {**data, "model": SERVED_MODEL}
            return method(self, method_name, path, data, *args, **kwargs)
        return call

    for name in ("make_request", "make_stream_request"):
        setattr(utils.ServerProcess, name, with_model(getattr(utils.ServerProcess, name)))
