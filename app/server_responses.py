"""OpenAI's Responses API on `moedesk serve`, the stateless part: POST /v1/responses with input items,
instructions, function tools, text.format and reasoning.effort, plain or streamed as its typed events.

Nothing is stored: `previous_response_id` and `conversation` are refused (send the whole input instead), and
`store` is accepted but answered as false. The request becomes the OpenAI chat body the server's one request
path takes (Server.start); reasoning, the answer and tool calls come back as output items.
"""
from __future__ import annotations

import json
import time
import uuid

from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route

from moedesk.app.api_errors import ApiError

UNSUPPORTED = ("previous_response_id", "conversation", "background", "prompt")  # need state this server keeps not
MESSAGE_ROLES = ("system", "developer", "user", "assistant")


def routes(server) -> list[Route]:
    api = ResponsesApi(server)
    return [Route(path, api.create, methods=["POST"]) for path in ("/v1/responses", "/responses")]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _output(whole) -> list[dict]:
    """A whole reply's output items: its reasoning, its message (empty too, unless it only calls tools), its calls."""
    output = []
    if whole.reasoning:
        output.append(_reasoning(_id("rs"), whole.reasoning))
    if whole.content or not whole.tool_calls:
        output.append(_message(_id("msg"), whole.content))
    return output + [_call(_id("fc"), call) for call in whole.tool_calls]


class ResponsesApi:
    def __init__(self, server):
        self.server = server

    async def create(self, http: HttpRequest) -> Response:
        server = self.server
        server._authorise(http)
        body = await server._json_body(http)
        chat = chat_body(body)
        job = await server.start(chat, chat=True)
        head = _head(body, chat)
        return await server.reply(http, job, lambda: self._events(job, head),
                                  lambda done: _finished(head, done, _output(job.reader.whole)))

    async def _events(self, job, head: dict):
        sequence = 0
        output: list[dict] = []
        open_item: dict | None = None  # the reasoning or message item text is streaming into

        def event(kind: str, **fields) -> bytes:
            nonlocal sequence
            payload = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

        def close():
            nonlocal open_item
            item, open_item = open_item, None
            if item is None:
                return []
            index = output.index(item)
            text = item["_text"]
            del item["_text"]
            if item["type"] == "reasoning":
                part = {"type": "reasoning_text", "text": text}
                item["content"] = [part]
                done = [event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text)]
            else:
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                item["content"] = [part]
                done = [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=text, logprobs=[])]
            item["status"] = "completed"
            return done + [event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part),
                           event("response.output_item.done", output_index=index, item=_public(item))]

        def text(kind: str, piece: str):
            nonlocal open_item
            events = []
            if open_item is None or open_item["type"] != kind:
                events += close()
                item = (_reasoning(_id("rs"), "") if kind == "reasoning" else _message(_id("msg"), ""))
                item.update(status="in_progress", content=[], _text="")
                output.append(item)
                open_item = item
                part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                    {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                events += [event("response.output_item.added", output_index=len(output) - 1, item=_public(item)),
                           event("response.content_part.added", item_id=item["id"], output_index=len(output) - 1,
                                 content_index=0, part=part)]
            open_item["_text"] += piece
            index = len(output) - 1
            if kind == "reasoning":
                events.append(event("response.reasoning_text.delta", item_id=open_item["id"], output_index=index,
                                    content_index=0, delta=piece))
            else:
                events.append(event("response.output_text.delta", item_id=open_item["id"], output_index=index,
                                    content_index=0, delta=piece, logprobs=[]))
            return events

        calls: dict[int, dict] = {}  # a streamed call's item, by the call's index in the reply

        def call_delta(delta):
            events = []
            if delta.name is not None:  # a call begins: its item, then its arguments as they are written
                events += close()
                item = _call(_id("fc"), delta)
                item.update(arguments="", status="in_progress")
                output.append(item)
                calls[delta.index] = item
                events.append(event("response.output_item.added", output_index=len(output) - 1, item=dict(item)))
            item = calls[delta.index]
            if delta.arguments:
                item["arguments"] += delta.arguments
                events.append(event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=output.index(item), delta=delta.arguments))
            return events

        def call_done(index: int, call):
            item = calls[index]
            item.update(arguments=call.arguments, status="completed")
            at = output.index(item)
            return [event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                          name=call.name, arguments=call.arguments),
                    event("response.output_item.done", output_index=at, item=dict(item))]

        start = {**head, "status": "in_progress", "output": []}
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        try:
            async for piece, done in self.server.pieces(job):
                for chunk in (text("reasoning", piece.reasoning) if piece.reasoning else []) + \
                        (text("message", piece.content) if piece.content else []):
                    yield chunk
                for delta in piece.call_deltas:
                    for chunk in call_delta(delta):
                        yield chunk
                for call in piece.tool_calls:  # whole calls come in order
                    for chunk in call_done(sum(c["status"] == "completed" for c in calls.values()), call):
                        yield chunk
                if done is not None:
                    if not output:  # an empty answer is still a message
                        for chunk in text("message", ""):
                            yield chunk
                    for chunk in close():
                        yield chunk
                    yield event("response.completed", response=_finished(head, done, output))
        except ApiError as e:
            yield event("error", code=e.code, message=e.message, param=e.param)


def chat_body(body: dict) -> dict:
    """A Responses request as the OpenAI chat body the server's request path takes (ApiError 400 on bad input)."""
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False):
            raise ApiError(400, f"'{name}' needs a stored response; this server is stateless: send the whole input",
                           name, "unsupported_parameter")
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "'instructions' must be a string", "instructions", "invalid_type")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if given is None:
        raise ApiError(400, "Missing required parameter: 'input'", "input", "missing_required_parameter")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for i, item in enumerate(given):
            messages += _input_item(item, i, messages)
    else:
        raise ApiError(400, "'input' must be a string or a list of input items", "input", "invalid_type")
    if not messages or all(m["role"] == "system" for m in messages):
        raise ApiError(400, "'input' holds no message", "input", "invalid_value")
    chat = {"model": body.get("model"), "messages": messages, "stream": body.get("stream", False)}
    for name in ("temperature", "top_p", "parallel_tool_calls", "top_k", "seed", "stop", "chat_template_kwargs"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise ApiError(400, "'reasoning' must be an object", "reasoning", "invalid_type")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
            raise ApiError(400, "'text' must be an object {\"format\": {...}}", "text", "invalid_type")
        if fmt is not None and fmt.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "format"), "schema": fmt.get("schema", {})}}
        elif fmt is not None:
            chat["response_format"] = {k: v for k, v in fmt.items() if k == "type"}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list", "tools", "invalid_type")
        chat["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    return chat


def _tool(tool, index: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise ApiError(400, f"tools[{index}]: only function tools {{\"type\": \"function\", \"name\": ...}} are "
                            f"supported", f"tools[{index}]", "invalid_value")
    function = {"name": tool["name"], "parameters": tool.get("parameters")}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _input_item(item, index: int, messages: list) -> list[dict]:
    """One input item as chat messages (a function call joins the assistant turn before it)."""
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise ApiError(400, f"{where} must be an object", where, "invalid_type")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}", where + ".role",
                           "invalid_value")
        return [{"role": role, "content": item.get("content")}]
    if kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
            raise ApiError(400, f"{where}: a function_call needs a string name and arguments", where, "invalid_value")
        call = {"id": item.get("call_id") or _id("call"), "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
            messages[-1]["tool_calls"].append(call)
            return []
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, (str, list)):
            raise ApiError(400, f"{where}.output must be a string", where + ".output", "invalid_type")
        return [{"role": "tool", "tool_call_id": item.get("call_id"), "content": output}]
    if kind == "reasoning":
        return []  # a past turn's reasoning: chat templates drop it from earlier turns
    raise ApiError(400, f"{where}: items of type {kind!r} are not supported", where + ".type", "invalid_value")


def _head(body: dict, chat: dict) -> dict:
    """The fields of the Response object that echo the request."""
    tools = chat.get("tools") or []
    return {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "model": body.get("model"),
            "instructions": body.get("instructions") if isinstance(body.get("instructions"), str) else None,
            "tools": [{"type": "function", "name": t["function"]["name"],
                       "description": t["function"].get("description"),
                       "parameters": t["function"].get("parameters"), "strict": False} for t in tools],
            "tool_choice": body.get("tool_choice") if body.get("tool_choice") is not None else "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "temperature": chat.get("temperature", 1.0), "top_p": chat.get("top_p", 1.0),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "error": None, "incomplete_details": None, "previous_response_id": None, "store": False,
            "truncation": "disabled", "text": {"format": {"type": "text"}},
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None}}


def _finished(head: dict, done, output: list) -> dict:
    cut = done.finish_reason == "length"
    return {**head, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": [_public(item) for item in output],
            "usage": {"input_tokens": done.prompt_tokens, "output_tokens": len(done.token_ids),
                      "total_tokens": done.prompt_tokens + len(done.token_ids),
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}  # not counted apart


def _public(item: dict) -> dict:
    return {k: v for k, v in item.items() if not k.startswith("_")}


def _reasoning(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _message(item_id: str, text: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call(item_id: str, call) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": "call_" + item_id[3:27], "name": call.name,
            "arguments": call.arguments, "status": "completed"}

