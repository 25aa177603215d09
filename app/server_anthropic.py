"""Anthropic's Messages API on `moedesk serve`: POST /v1/messages, plain or streamed as its typed events, so that
tools built on the anthropic client (coding agents among them) run on a local model.

Text, `tools` with `tool_use` and `tool_result` blocks, `tool_choice`, `stop_sequences`, `system`, a thinking
model's reasoning as `thinking` blocks (`thinking` enabled or disabled reaches the chat template as
enable_thinking), `output_config` (`effort` as reasoning_effort, `format` as a JSON-schema response_format), and
`temperature`, `top_p`, `top_k` where a client still sends them (the anthropic client now only as extra_body).
Images, documents and server tools are refused. The request becomes the OpenAI chat body the server's one request
path takes (Server.start), as the Responses API's does; errors come as Anthropic's
{"type": "error", "error": {"type", "message"}}. The key may come as `x-api-key`, as the anthropic client sends it.
"""
from __future__ import annotations

import json
import uuid

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from moedesk.app.api_errors import ApiError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
ROLES = ("user", "assistant")
SAMPLING = ("temperature", "top_p", "top_k")  # the same name and meaning in both APIs
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's -> OpenAI's
EFFORTS = {"xhigh": "high", "max": "high"}  # Anthropic's efforts beyond the chat templates' three


def routes(server) -> list[Route]:
    api = MessagesApi(server)
    return [Route("/v1/messages", api.create, methods=["POST"]),
            Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"])]


def _id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(_error(e), e.status, headers=e.headers)


def _error(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


class MessagesApi:
    def __init__(self, server):
        self.server = server

    async def create(self, http: HttpRequest) -> Response:
        server = self.server
        try:
            server._authorise(http)
            body = await server._json_body(http)
            chat = chat_body(body)
            job = await server.start(chat, chat=True)
        except ApiError as e:
            return error_response(e)
        head = {"id": _id("msg_"), "type": "message", "role": "assistant", "model": body.get("model")}
        stops = tuple(chat.get("stop") or ())
        try:  # the server's own reply: streamed, or the whole once done (499 when the client left first)
            return await server.reply(http, job, lambda: self._events(job, head, stops),
                                      lambda done: _message(head, done, job.reader, stops))
        except ApiError as e:
            return error_response(e)

    async def count_tokens(self, http: HttpRequest) -> Response:
        """The prompt's tokens as /v1/messages would feed them (the model loaded to read its template)."""
        server = self.server
        try:
            server._authorise(http)
            chat = chat_body({"max_tokens": 1, **await server._json_body(http)})
            entry = await server.acquire(chat["model"])
            try:
                prepared = await run_in_threadpool(server._prepare, chat, True)
            finally:
                server.pool.release(entry)
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"input_tokens": len(prepared.request.prompt_ids)})

    async def _events(self, job, head: dict, stops: tuple[str, ...]):
        blocks: list[str] = []  # the kind of each content block started, by index
        open_block: str | None = None

        def event(kind: str, **fields) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n".encode()

        def close() -> list[bytes]:
            nonlocal open_block
            if open_block is None:
                return []
            open_block = None
            return [event("content_block_stop", index=len(blocks) - 1)]

        def begin(kind: str, block: dict) -> list[bytes]:
            nonlocal open_block
            events = close()
            blocks.append(kind)
            open_block = kind
            return events + [event("content_block_start", index=len(blocks) - 1, content_block=block)]

        def text(kind: str, piece: str) -> list[bytes]:
            events = [] if open_block == kind else begin(
                kind, {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else
                {"type": "text", "text": ""})
            delta = {"type": "thinking_delta", "thinking": piece} if kind == "thinking" else \
                {"type": "text_delta", "text": piece}
            return events + [event("content_block_delta", index=len(blocks) - 1, delta=delta)]

        prompt_tokens = len(job.prepared.request.prompt_ids)
        yield event("message_start", message={**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                              "usage": _usage(prompt_tokens, 0)})
        calls = 0
        try:
            async for piece, done in self.server.pieces(job):
                out = (text("thinking", piece.reasoning) if piece.reasoning else []) + \
                    (text("text", piece.content) if piece.content else [])
                for delta in piece.call_deltas:
                    if delta.name is not None:  # a call begins; its input follows as JSON text
                        calls += 1
                        out += begin("tool_use", _tool_use(delta.name, {}))
                    if delta.arguments:
                        out.append(event("content_block_delta", index=len(blocks) - 1,
                                         delta={"type": "input_json_delta", "partial_json": delta.arguments}))
                for chunk in out:
                    yield chunk
                if done is not None:
                    ending = ([] if blocks else text("text", "")) + close()
                    for chunk in ending:
                        yield chunk
                    yield event("message_delta", delta=_stopped(done, [None] * calls, stops, job.reader.tokenizer),
                                usage={"output_tokens": len(done.token_ids)})
                    yield event("message_stop")
        except ApiError as e:
            yield event("error", error=_error(e)["error"])


def _message(head: dict, done, reader, stops: tuple[str, ...]) -> dict:
    """The whole reply as Anthropic's message: thinking, text and tool_use blocks."""
    whole = reader.whole
    content = ([{"type": "thinking", "thinking": whole.reasoning, "signature": ""}] if whole.reasoning else []) + \
        ([{"type": "text", "text": whole.content}] if whole.content or not whole.tool_calls else []) + \
        [_tool_use(call.name, _input(call.arguments)) for call in whole.tool_calls]
    return {**head, "content": content, **_stopped(done, whole.tool_calls, stops, reader.tokenizer),
            "usage": _usage(done.prompt_tokens, len(done.token_ids))}


def _stopped(done, calls, stops: tuple[str, ...], tokenizer) -> dict:
    """stop_reason and stop_sequence: the stop string the reply ended at is the one its tokens go on with."""
    if calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if done.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    after = tokenizer.decode(done.token_ids)[len(done.text):] if stops and tokenizer is not None else ""
    stop = next((s for s in stops if after.startswith(s)), None)
    return {"stop_reason": "stop_sequence" if stop else "end_turn", "stop_sequence": stop}


def chat_body(body: dict) -> dict:
    """A Messages request as the OpenAI chat body the server's request path takes (ApiError 400 on bad input)."""
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, "max_tokens: a positive integer is required", "max_tokens", "invalid_value")
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise ApiError(400, "messages: a non-empty list is required", "messages", "invalid_value")
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"], "system")})
    for i, message in enumerate(given):
        messages += _messages(message, f"messages.{i}")
    chat = {"model": body.get("model"), "messages": messages, "max_tokens": max_tokens,
            "stream": body.get("stream", False)}
    chat.update((name, body[name]) for name in SAMPLING if body.get(name) is not None)
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list):
            raise ApiError(400, "tools: a list is required", "tools", "invalid_type")
        chat["tools"] = [_tool(tool, f"tools.{i}") for i, tool in enumerate(body["tools"])]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool" and isinstance(choice.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in TOOL_CHOICES:
            chat["tool_choice"] = TOOL_CHOICES[kind]
        else:
            raise ApiError(400, "tool_choice: type must be auto, any, tool (with a name) or none", "tool_choice",
                           "invalid_value")
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and isinstance(thinking.get("type"), str):  # enabled, adaptive, ...: on
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, dict):
            raise ApiError(400, "output_config: an object is required", "output_config", "invalid_type")
        if config.get("effort") is not None:
            chat["reasoning_effort"] = EFFORTS.get(config["effort"], config["effort"])
        fmt = config.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise ApiError(400, "output_config.format: {\"type\": \"json_schema\", \"schema\": {...}} is required",
                               "output_config.format", "invalid_value")
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                              "schema": fmt["schema"]}}
    return chat


def _text(value, where: str) -> str:
    """A string, or text blocks joined (the form `system` and a tool result's content may take)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" and
                                       isinstance(b.get("text"), str) for b in value):
        return "".join(b["text"] for b in value)
    raise ApiError(400, f"{where}: a string or a list of text blocks is required", where, "invalid_value")


def _messages(message, where: str) -> list[dict]:
    """One Anthropic message as chat messages: a user turn's tool results become tool messages before its text;
    an assistant turn's tool_use blocks become its tool calls; past thinking is dropped, as templates drop it."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise ApiError(400, f"{where}: an object with role user or assistant is required", where, "invalid_value")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: a string or a list of blocks is required", where + ".content",
                       "invalid_type")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
            calls.append({"id": block.get("id") or _id("toolu_"), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            result = _text(block.get("content", ""), at + ".content")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": f"Error: {result}" if block.get("is_error") else result})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise ApiError(400, f"{at}: blocks of type {kind!r} are not supported in a {role} message", at,
                           "invalid_value")
    turn = {"role": role, "content": "".join(texts) if texts or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return results + ([turn] if texts or calls or not results else [])


def _tool(tool, where: str) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or tool.get("type") not in (None,
                                                                                                      "custom"):
        raise ApiError(400, f"{where}: only custom tools {{\"name\", \"input_schema\"}} are supported", where,
                       "invalid_value")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_use(name: str, arguments: dict) -> dict:
    return {"type": "tool_use", "id": _id("toolu_"), "name": name, "input": arguments}


def _input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's tool_use carries (a model's malformed JSON: the text kept)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _usage(prompt_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}
