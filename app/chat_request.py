"""The chat fields of an OpenAI-style request (and its stop strings), checked and turned into what the chat
template and the grammar engine take: messages (tool calls and tool results included), `tools` / `tool_choice` /
`parallel_tool_calls`, and the template's switches (`chat_template_kwargs`, `reasoning_effort`). Shared by
`moedesk serve` (every API it speaks) and `moedesk batch`; pure functions, errors as BadField (one line, the field
named).

With `tool_choice` "required" or a named function the reply is not left to the model's own markup: it is
constrained (as vLLM does it) to a JSON list of calls, [{"name": ..., "arguments": {...}}], whose arguments
follow each function's JSON schema, and parsed back from that list.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from moedesk.engine.load.reply_format import CALL_LIST, ToolCall, parse_reply

ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's
REASONING_EFFORTS = ("minimal", "low", "medium", "high")
# Calls one forced reply may hold: the grammar closes the list there, so a model that would go on listing calls
# (a small one does) cannot spend its whole budget on them.
MAX_FORCED_CALLS = 8
# Variables the server itself hands every template: a request's chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_NAMES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
# OpenAI's API takes 4 stop strings; tools written for local servers send more (Continue's autocomplete about 10)
# and vLLM's and llama.cpp's servers take them. The bounds keep the check of a streamed reply's held-back text
# for a stop's start (on the event loop for every token; engine.generation.scheduler._held_back: strings x the
# places a stop's first character occurs in its length's tail) well under a millisecond a token
# (docs/measurements.md, "The server's stop strings").
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256


class BadField(ValueError):
    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Tools:
    """What a request asked of tools: the definitions the template shows (None: none offered, or tool_choice
    "none"), the JSON schema a forced reply follows (None: the model chooses), and whether several calls may
    come back at once."""

    offered: list | None = None
    forced: dict | None = None
    parallel: bool = True


NO_TOOLS = Tools()


def message(value, index: int, where: str = "messages") -> dict:
    """One message as templates take it: text content, and an assistant's tool_calls with their arguments as
    objects (templates write them with `tojson`), a tool result's tool_call_id and name."""
    where = f"{where}[{index}]"
    if not isinstance(value, dict) or not isinstance(value.get("role"), str):
        raise BadField(f"{where} must be an object with a string 'role'", where, "invalid_type")
    role = value["role"]
    if role not in ROLES:
        raise BadField(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", where + ".role")
    if value.get("content") is None and not (role == "assistant" and value.get("tool_calls")):
        # OpenAI's API: only an assistant turn that calls tools may go without content
        raise BadField(f"Missing required parameter: '{where}.content'", where + ".content",
                       "missing_required_parameter")
    out = {"role": role, "content": text_content(value.get("content"), where + ".content")}
    if role == "assistant" and value.get("tool_calls") is not None:
        calls = value["tool_calls"]
        if not isinstance(calls, list):
            raise BadField(f"{where}.tool_calls must be a list", where + ".tool_calls", "invalid_type")
        out["tool_calls"] = [_past_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    for key in ("tool_call_id", "name", "reasoning_content"):
        if isinstance(value.get(key), str):
            out[key] = value[key]
    return out


def text_content(content, where: str) -> str:
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text") \
                    or not isinstance(part.get("text"), str):
                raise BadField(f"{where}: only text parts are supported", where, "invalid_type")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    if not isinstance(content, str):
        raise BadField(f"{where} must be a string or a list of text parts", where, "invalid_type")
    return content


def _past_call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadField(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                       where, "invalid_type")
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # OpenAI sends JSON text; templates write an object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # not JSON: the template gets the text as the client wrote it
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def tools(body: dict) -> Tools:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request."""
    defined = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise BadField("parallel_tool_calls must be a boolean", "parallel_tool_calls", "invalid_type")
    if defined is None or defined == []:
        if choice not in (None, "none", "auto"):
            raise BadField("tool_choice names a tool, but the request defines no tools", "tool_choice")
        return NO_TOOLS
    if not isinstance(defined, list):
        raise BadField("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools",
                       "invalid_type")
    functions = [_function(t, i) for i, t in enumerate(defined)]
    names = [f["function"]["name"] for f in functions]
    if choice is None or choice == "auto":
        return Tools(functions, None, parallel)
    if choice == "none":
        return NO_TOOLS
    if choice == "required":
        return Tools(functions, _calls_schema(functions, parallel), parallel)
    named = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = named.get("name") if isinstance(named, dict) else choice.get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise BadField('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                       '{"name": ...}}', "tool_choice", "invalid_type" if not isinstance(choice, (str, dict))
                       else "invalid_value")
    if name not in names:
        raise BadField(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
    chosen = [f for f in functions if f["function"]["name"] == name]
    return Tools(functions, _calls_schema(chosen, False), False)


def _function(tool, index: int) -> dict:
    where = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
        raise BadField(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                       where, "invalid_type")
    name = function.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise BadField(f"{where}.function.name must be a string of 1 to 64 characters", where + ".function.name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise BadField(f"{where}.function.parameters must be a JSON schema object", where + ".function.parameters",
                       "invalid_type")
    out = {"name": name, "parameters": parameters if parameters else {"type": "object", "properties": {}}}
    if isinstance(function.get("description"), str):
        out["description"] = function["description"]
    return {"type": "function", "function": out}


def _calls_schema(functions: list[dict], parallel: bool) -> dict:
    """The JSON schema of a forced reply: a list of one call (several when parallel) to the given functions."""
    variants = [{"type": "object", "properties": {"name": {"const": f["function"]["name"]},
                                                  "arguments": f["function"]["parameters"]},
                 "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    item = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {"type": "array", "items": item, "minItems": 1, "maxItems": MAX_FORCED_CALLS if parallel else 1}


def forced_response_format(schema: dict) -> dict:
    """The response_format that makes the grammar engine (engine.grammar) hold a reply to `schema`."""
    return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": schema}}


def forced_calls(text: str) -> tuple[ToolCall, ...]:
    """The calls of a forced reply (the constrained JSON list); () for a reply cut short before it closed."""
    return parse_reply(text, CALL_LIST).tool_calls


def template_options(body: dict) -> dict:
    """The template's own switches a request sets: `chat_template_kwargs` (as vLLM's and llama.cpp's servers take
    it, e.g. {"enable_thinking": false}) and `reasoning_effort` (gpt-oss's templates read it)."""
    options = body.get("chat_template_kwargs")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise BadField("chat_template_kwargs must be an object", "chat_template_kwargs", "invalid_type")
    reserved = sorted(set(options) & set(RESERVED_TEMPLATE_NAMES))
    if reserved:
        raise BadField(f"chat_template_kwargs may not set {reserved[0]!r}: the request's own fields do",
                       f"chat_template_kwargs.{reserved[0]}")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise BadField(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                           "reasoning_effort")
        options = {**options, "reasoning_effort": effort}
    return dict(options)


def stop_strings(value) -> tuple[str, ...]:
    """A request's `stop` (chat or text): none, one string or a list of them, each of 1 to MAX_STOP_CHARS."""
    if value is None:
        return ()
    if isinstance(value, str):
        stop = (value,)
    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
        stop = tuple(value)
    else:
        raise BadField(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop",
                       "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise BadField(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    if any(s == "" or len(s) > MAX_STOP_CHARS for s in stop):
        raise BadField(f"stop strings must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return stop
