"""OpenAI Batch API files in `moedesk batch`: a JSONL file written for OpenAI's /v1/batches runs here as it is.

A line that holds `custom_id` is OpenAI's request line: `url` names the endpoint (/v1/chat/completions or
/v1/completions) and `body` is that endpoint's request. It becomes a batch line whose id is the custom_id, and its
result is written as OpenAI's output line: `response.body` holds the chat.completion or text_completion that
`moedesk serve` would return, or `error` ({code, message}) says why the line did not run. Pure functions; a line
that cannot run raises ValueError with one line of text.
"""
from __future__ import annotations

import time
import uuid

ENDPOINTS = {"/v1/chat/completions": True, "/v1/completions": False}  # url -> whether it is a chat request
# Body fields a batch line takes under the same name.
SAME = ("temperature", "top_p", "seed", "stop", "response_format")
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "chat_template_kwargs")
# Body fields whose one value here is OpenAI's default: another value makes the line an error rather than a reply
# that silently ignores it (n = 2 would get one choice, logprobs none).
NEUTRAL = {"n": 1, "best_of": 1, "stream": False, "logprobs": False, "top_logprobs": None, "echo": False,
           "suffix": None, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None}
# Body fields that change nothing here: every line runs the batch's --model; the rest is OpenAI's bookkeeping.
IGNORED = ("model", "user", "metadata", "store", "service_tier", "stream_options", "prompt_cache_key",
           "safety_identifier")
ERROR_CODE = "line_failed"


def is_openai(obj: dict) -> bool:
    return "custom_id" in obj


def custom_id(obj: dict) -> str | None:
    """The line's custom_id where it is a non-empty string."""
    value = obj.get("custom_id")
    return value if isinstance(value, str) and value else None


def to_line(obj: dict) -> tuple[dict, bool, list[str]]:
    """(the batch line it asks for, whether it is a chat line, the body's fields neither used nor known).

    Raises ValueError for what cannot run: no custom_id, another method or endpoint, a body that is not an
    object, a prompt of another shape than one text or one list of token ids, a field at a value moedesk does not
    implement."""
    line_id = custom_id(obj)
    if line_id is None:
        raise ValueError("custom_id must be a non-empty string")
    method = obj.get("method", "POST")
    if method != "POST":
        raise ValueError(f"method must be POST, got {method!r}")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise ValueError(f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    chat = ENDPOINTS[url]
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object: the endpoint's request")
    line = {"id": line_id}
    if chat:
        line["messages"] = body.get("messages")
    else:
        line.update(_prompt(body.get("prompt")))
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if tokens is not None:
        line["max_new_tokens"] = tokens
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral and not (name == "logit_bias" and value == {}):
            raise ValueError(f"body.{name} {value!r} is not supported by moedesk batch (only {neutral!r})")
    used = {*SAME, *(CHAT_ONLY if chat else ()), "messages" if chat else "prompt", "max_tokens",
            "max_completion_tokens", *NEUTRAL, *IGNORED}
    line.update((name, body[name]) for name in (*SAME, *(CHAT_ONLY if chat else ())) if body.get(name) is not None)
    if not chat and body.get("tools"):
        raise ValueError("body.tools needs url /v1/chat/completions")
    return line, chat, sorted(set(body) - used - {"tools"})


def _prompt(value) -> dict:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        return {"prompt": value}
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return {"prompt_ids": value}
    raise ValueError("body.prompt must be one text or one list of token ids (a line is one request)")


def output(line_id: str | None, record: dict, chat: bool, model: str) -> dict:
    """OpenAI's output line for a batch record: the reply as the endpoint's response body, or the error."""
    if "error" in record:
        return {"id": _new_id("batch_req_"), "custom_id": line_id, "response": None,
                "error": {"code": ERROR_CODE, "message": record["error"]}}
    reply_id = _new_id("chatcmpl-" if chat else "cmpl-")
    calls = record.get("tool_calls") or []
    finish = "tool_calls" if calls else "length" if record["finish_reason"] == "length" else "stop"
    if chat:
        message = {"role": "assistant", "content": record["text"] if record["text"] or not calls else None,
                   "refusal": None}
        if record.get("reasoning"):
            message["reasoning_content"] = record["reasoning"]
        if calls:
            message["tool_calls"] = [{"id": f"call_{reply_id[-12:]}{i}", **call} for i, call in enumerate(calls)]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": record["text"], "logprobs": None, "finish_reason": finish}
    usage = record["usage"]
    body = {"id": reply_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
            "moedesk": {**record.get("stats", {}), "token_ids": record["token_ids"]}}
    return {"id": _new_id("batch_req_"), "custom_id": line_id,
            "response": {"status_code": 200, "request_id": _new_id("req_"), "body": body}, "error": None}


def written(record: dict) -> tuple[str | None, bool, str]:
    """(custom_id, whether it succeeded, its error message) of an output line this module wrote."""
    error = record.get("error")
    message = error.get("message", "") if isinstance(error, dict) else ""
    return custom_id(record), error is None and isinstance(record.get("response"), dict), str(message)


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]
