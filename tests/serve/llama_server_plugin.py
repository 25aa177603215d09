"""A pytest plugin that lets llama.cpp's server tests (tools/server/tests in a llama.cpp tree) drive `moedesk serve`
in their external mode (DEBUG_EXTERNAL: they send requests to a server already running on PORT and start none).

Three adaptations, nothing else: `wget` (which their utils import to fetch models, unused here) is stood in for when
it is not installed; a request that names no model names the served one, since OpenAI's API, which moedesk follows,
requires `model` where llama-server ignores it; and one that names no length gets their preset's `n_predict`, which
llama-server is started with (`--n-predict`) and applies to such a request (moedesk's default is the context's room).
Server settings of a preset (an API key) are given to `moedesk serve` by the runner, per file. tests/serve/llama_server_suite.py runs them with it."""
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
            route = path.split("?")[0].rstrip("/")
            if isinstance(data, dict) and route.endswith(("completions", "responses")):
                if data.get("model") is None:
                    data = {**data, "model": SERVED_MODEL}
                # llama-server is started with the preset's --n-predict, its default for a request naming none
                limit = "max_output_tokens" if route.endswith("responses") else "max_tokens"
                named = {"max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict"} & set(data)
                if self.n_predict and not named:
                    data = {**data, limit: self.n_predict}
            return method(self, method_name, path, data, *args, **kwargs)
        return call

    for name in ("make_request", "make_stream_request"):
        setattr(utils.ServerProcess, name, with_model(getattr(utils.ServerProcess, name)))
