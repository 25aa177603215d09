"""The Ollama API of `moedesk serve`, so that Ollama's clients work unchanged: /api/chat, /api/generate,
/api/tags, /api/show, /api/ps, /api/version.

A request's `keep_alive` (seconds, or a duration such as "5m"; 0: unload once idle; negative: never) sets how long
its model stays loaded after it, as Ollama's does; without one, the server's --keep-alive applies. A load request
(an empty prompt or no messages) with keep_alive 0 unloads the model, as `ollama stop` asks.

Each request is turned into the OpenAI-style body the server's one request path takes (Server.start), and the
reply back into Ollama's shape. Streaming is Ollama's: one JSON object per line (application/x-ndjson), the
last with "done": true and the counts and durations (nanoseconds). Errors are Ollama's {"error": "..."} with
the HTTP status the OpenAI routes would give. Sampling defaults are the Ollama API's (temperature 0.8, top_k 40,
top_p 0.9) where a request sets none.
"""
from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timedelta, timezone

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from moedesk import __version__ as moedesk_version
from moedesk.app.api_errors import ApiError
from moedesk.app.model_registry import UNSET, expires_in, parse_keep_alive

VERSION = "0.12.0"  # the Ollama API version whose behaviour this follows; clients only compare it
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # the Ollama API's, where a request sets none
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
           "num_predict": "max_tokens", "stop": "stop"}  # the options this server honours, as OpenAI fields


class OllamaError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def routes(server) -> list[Route]:
    api = OllamaApi(server)
    return [Route("/api/chat", api.chat, methods=["POST"]), Route("/api/generate", api.generate, methods=["POST"]),
            Route("/api/tags", api.tags, methods=["GET"]), Route("/api/show", api.show, methods=["POST"]),
            Route("/api/ps", api.ps, methods=["GET"]), Route("/api/version", api.version, methods=["GET"])]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class OllamaApi:
    def __init__(self, server):
        self.server = server

    # --- endpoints ---------------------------------------------------------------------------------

    async def version(self, http: HttpRequest) -> Response:
        return await self._guarded(http, lambda: JSONResponse({"version": VERSION, "moedesk": moedesk_version}))

    async def tags(self, http: HttpRequest) -> Response:
        return await self._guarded(http, lambda: JSONResponse({"models": [self._card(e)
                                                                           for e in self.server.pool.listing()]}))

    async def ps(self, http: HttpRequest) -> Response:
        """What is loaded now, and until when it stays (as Ollama's; far ahead when it never unloads)."""
        pool = self.server.pool

        def expires(entry) -> str:
            left = expires_in(entry, pool.clock(), pool.keep_alive)
            left = 365 * 86400 if left is None else left
            return (datetime.now(timezone.utc) + timedelta(seconds=left)).isoformat().replace("+00:00", "Z")
        return await self._guarded(http, lambda: JSONResponse({"models": [
            {**self._card(e), "expires_at": expires(e), "size_vram": 0, "context_length": e.engine.context_length}
            for e in pool.entries if e.loaded]}))

    async def show(self, http: HttpRequest) -> Response:
        async def answer():
            body = await self._body(http)
            entry = await self.server.acquire(self._model(body))  # its template and details are the loaded model's
            try:
                engine = entry.engine
            finally:
                self.server.pool.release(entry)
            tokenizer = engine.tokenizer
            fmt = tokenizer.reply_format if tokenizer is not None else None
            capabilities = ["completion"] + (["tools"] if fmt is not None and fmt.tools else []) + \
                (["thinking"] if fmt is not None and (fmt.think or fmt.tools == "harmony") else [])
            return JSONResponse({
                "modelfile": f"# moedesk serves {engine.description}\n", "parameters": "", "license": "",
                "template": (tokenizer.chat_template or "") if tokenizer is not None else "",
                "details": self._details(entry), "capabilities": capabilities,
                "model_info": {"general.architecture": engine.config.arch,
                               "general.context_length": engine.context_length},
                "modified_at": _now()})
        return await self._guarded(http, answer)

    async def chat(self, http: HttpRequest) -> Response:
        async def answer():
            body = await self._body(http)
            if body.get("messages") in (None, []):  # Ollama's way to load (or, keep_alive 0, unload) a model
                return await self._load(body, "message", {"role": "assistant", "content": ""})
            return await self._reply(http, body, self._chat_body(body), chat_api=True)
        return await self._guarded(http, answer)

    async def generate(self, http: HttpRequest) -> Response:
        async def answer():
            body = await self._body(http)
            prompt = body.get("prompt")
            if prompt is not None and not isinstance(prompt, str):
                raise OllamaError(400, "prompt must be a string")
            if not prompt:
                return await self._load(body, "response", "")
            return await self._reply(http, body, self._generate_body(body), chat_api=False)
        return await self._guarded(http, answer)

    async def _load(self, body: dict, field: str, empty) -> Response:
        """A request with nothing to generate loads its model, or with keep_alive 0 unloads it."""
        model, keep_alive = self._model(body), self._keep_alive(body)
        if keep_alive == 0:
            await self.server.pool.unload(self.server.pool.find(model))
            reason = "unload"
        else:
            self.server.pool.release(await self.server.acquire(model), keep_alive)
            reason = "load"
        return JSONResponse({"model": body.get("model"), "created_at": _now(), field: empty, "done": True,
                             "done_reason": reason})

    # --- requests --------------------------------------------------------------------------------------

    async def _guarded(self, http: HttpRequest, answer) -> Response:
        """Run an endpoint with the key checked and every error as Ollama's {"error": ...}."""
        try:
            self.server._authorise(http)
            result = answer()
            return await result if hasattr(result, "__await__") else result
        except ApiError as e:
            return JSONResponse({"error": e.message}, e.status, headers=e.headers)
        except OllamaError as e:
            return JSONResponse({"error": e.message}, e.status)

    async def _body(self, http: HttpRequest) -> dict:
        return await self.server._json_body(http)

    def _model(self, body: dict) -> str:
        """The id the server knows the requested model by (404 as Ollama's for one it cannot serve)."""
        name = body.get("model", body.get("name"))
        if not isinstance(name, str) or not name:
            raise OllamaError(400, "model is required")
        entry = self.server.pool.find(name)
        if entry is None:
            served = ", ".join(f"'{_tagged(e.name)}'" for e in self.server.pool.entries)
            raise OllamaError(404, f"model '{name}' not found; this server serves {served}")
        return entry.name

    @staticmethod
    def _keep_alive(body: dict):
        """The request's keep_alive in seconds (None: never unload; UNSET: none given, the server's applies)."""
        value = body.get("keep_alive")
        if value is None:
            return UNSET
        try:
            return parse_keep_alive(value)
        except ValueError as e:
            raise OllamaError(400, f"keep_alive: {e}") from None

    def _sampling(self, body: dict) -> dict:
        options = body.get("options")
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise OllamaError(400, "options must be an object")
        out = dict(DEFAULTS)
        for key, field in OPTIONS.items():
            if options.get(key) is not None:
                out[field] = options[key]
        if isinstance(out.get("max_tokens"), int) and not isinstance(out["max_tokens"], bool) \
                and out["max_tokens"] < 0:
            del out["max_tokens"]  # -1: until the context is full; -2: fill it
        fmt = body.get("format")
        if fmt == "json":
            out["response_format"] = {"type": "json_object"}
        elif isinstance(fmt, dict):
            out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
        elif fmt not in (None, ""):
            raise OllamaError(400, 'format must be "json" or a JSON schema object')
        think = body.get("think")
        if think is True or think is False:
            out["chat_template_kwargs"] = {"enable_thinking": think}
        elif think in ("low", "medium", "high"):
            out["chat_template_kwargs"] = {"enable_thinking": True}
            out["reasoning_effort"] = think
        elif think is not None:
            raise OllamaError(400, 'think must be true, false, "low", "medium" or "high"')
        stream = body.get("stream", True)  # Ollama streams unless told not to
        if not isinstance(stream, bool):
            raise OllamaError(400, "stream must be a boolean")
        out["stream"] = stream
        return out

    def _chat_body(self, body: dict) -> dict:
        model = self._model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise OllamaError(400, "messages must be a non-empty list")
        converted = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise OllamaError(400, f"messages[{i}] must be an object")
            if m.get("images"):
                raise OllamaError(400, f"messages[{i}]: images are not supported by this model")
            out = {k: v for k, v in m.items() if k in ("role", "content")}
            if m.get("thinking"):
                out["reasoning_content"] = m["thinking"]
            if m.get("tool_name"):
                out["name"] = m["tool_name"]
            if m.get("tool_calls"):
                calls = m["tool_calls"]
                if not isinstance(calls, list):
                    raise OllamaError(400, f"messages[{i}].tool_calls must be a list")
                out["tool_calls"] = [{"type": "function", "function": c.get("function")} if isinstance(c, dict)
                                     else c for c in calls]
                out.setdefault("content", "")
            converted.append(out)
        chat = {"model": model, "messages": converted, **self._sampling(body)}
        if body.get("tools"):
            chat["tools"] = body["tools"]
        return chat

    def _generate_body(self, body: dict) -> dict:
        model = self._model(body)
        for unsupported in ("images", "suffix", "context", "template"):
            if body.get(unsupported):
                raise OllamaError(400, f"{unsupported} is not supported by this server")
        sampling = self._sampling(body)
        if body.get("raw"):
            if "chat_template_kwargs" in sampling or "reasoning_effort" in sampling:
                raise OllamaError(400, "think needs the chat template: it cannot be combined with raw")
            return {"model": model, "prompt": body["prompt"], **sampling}
        system = body.get("system")
        messages = ([{"role": "system", "content": system}] if isinstance(system, str) and system else []) + \
            [{"role": "user", "content": body["prompt"]}]
        return {"model": model, "messages": messages, **sampling}

    # --- replies ------------------------------------------------------------------------------------------

    async def _reply(self, http: HttpRequest, body: dict, openai_body: dict, chat_api: bool) -> Response:
        server = self.server
        model = body.get("model")
        started = time.perf_counter()
        job = await server.start(openai_body, chat="messages" in openai_body, keep_alive=self._keep_alive(body))

        def line(payload: dict) -> bytes:
            return json.dumps(payload, ensure_ascii=False).encode() + b"\n"

        def piece(reasoning: str, content: str, calls) -> dict:
            if chat_api:
                message = {"role": "assistant", "content": content}
                if reasoning:
                    message["thinking"] = reasoning
                if calls:
                    message["tool_calls"] = [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                             for c in calls]
                return {"model": model, "created_at": _now(), "message": message}
            out = {"model": model, "created_at": _now(), "response": content}
            if reasoning:
                out["thinking"] = reasoning
            return out

        def last(done) -> dict:
            total = time.perf_counter() - started
            prefill = (done.stats or {}).get("ttft_s") or 0.0
            reason = "length" if done.finish_reason == "length" else "stop"
            return {"done": True, "done_reason": reason, "total_duration": int(total * 1e9), "load_duration": 0,
                    "prompt_eval_count": done.prompt_tokens, "prompt_eval_duration": int(prefill * 1e9),
                    "eval_count": len(done.token_ids), "eval_duration": int(max(total - prefill, 0) * 1e9)}

        async def lines():
            try:
                async for new, done in server.pieces(job):
                    if new.reasoning or new.content or new.tool_calls:
                        yield line({**piece(new.reasoning, new.content, new.tool_calls), "done": False})
                    if done is not None:
                        yield line({**piece("", "", ()), **last(done)})
            except ApiError as e:  # the stream's last line: done, as every last line is
                yield line({"error": e.message, "done": True, "done_reason": "error"})

        def whole(done) -> dict:
            reply = job.reader.whole
            return {**piece(reply.reasoning, reply.content, reply.tool_calls), **last(done)}

        return await server.reply(http, job, lines, whole, media_type="application/x-ndjson")

    # --- the models ------------------------------------------------------------------------------------------

    def _details(self, entry) -> dict:
        engine = entry.engine
        family = engine.config.arch if engine is not None else ""
        source = str(engine.name if engine is not None else entry.source)
        return {"parent_model": "", "format": "gguf" if source.endswith(".gguf") else "safetensors",
                "family": family, "families": [family] if family else None, "parameter_size": "",
                "quantization_level": ""}

    def _card(self, entry) -> dict:
        name = _tagged(entry.name)
        return {"name": name, "model": name, "modified_at": _now(), "size": 0,
                "digest": hashlib.sha256(entry.source.encode()).hexdigest(), "details": self._details(entry)}


def _tagged(name: str) -> str:
    """A model id as Ollama names models: with a tag (':latest' unless it has one)."""
    return name if ":" in name else f"{name}:latest"
