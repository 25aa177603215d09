"""The wire format of a remote completion: the body sent, the server-sent events read back, errors as one line.

Pure functions over plain data, so every decision is tested without a server. The prompt goes as token ids (the
OpenAI spec allows an array of integers; vLLM, SGLang, llama-server and `moedesk serve` accept it), which keeps the
chat template and tokenizer here and the tokens the server sees exactly the local engine's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from moedesk.engine.errors import EngineUnavailable, MoedeskError
from moedesk.engine.requests import Request


class RemoteError(MoedeskError):
    """A request the server refused or failed: its own one-line message."""


class RemoteUnavailable(RemoteError, EngineUnavailable):
    """The server cannot be reached (refused, timed out, went away mid-reply, wrong key): no request can run now,
    so a batch run stops at once instead of trying each line alone."""


def base_url(url: str) -> str:
    """The API root ending in /v1, from what a person types: host:port, http://host:port, .../v1 or .../v1/."""
    url = url.strip().rstrip("/")
    if not url:
        raise MoedeskError("--engine remote needs --url (the server's address, e.g. http://gpu-box:8000)")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise MoedeskError(f"--url {url}: only http:// and https:// servers are supported")
    return url if url.endswith("/v1") else url + "/v1"


def completion_body(model: str, request: Request, response_format=None) -> dict:
    """The POST /v1/completions body for one request, streamed. Extensions the OpenAI API lacks (top_k,
    ignore_eos) are sent only when they change something: every server named above takes them."""
    p = request.params
    body = {"model": model, "prompt": list(request.prompt_ids), "max_tokens": p.max_new_tokens,
            "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed, "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True}  # vLLM's name for the generated ids; moedesk serve sends them unasked
    if p.top_k:
        body["top_k"] = p.top_k
    if p.stop:
        body["stop"] = list(p.stop)
    if p.ignore_eos:
        body["ignore_eos"] = True
    if response_format is not None:
        body["response_format"] = response_format
    return body


@dataclass
class Event:
    """One server-sent event of a streamed completion, as far as the engine needs it."""

    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # the ids this event adds (vLLM), or all of them (moedesk serve, last event)
    all_ids: bool = False  # token_ids is the whole reply, not this event's part
    prompt_tokens: int | None = None
    done: bool = False  # data: [DONE]


def parse_event(line: str) -> Event | None:
    """One line of the SSE stream as an Event; None for comments, blank lines and other fields. A server's error
    event raises RemoteError with its message."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return Event(done=True)
    try:
        payload = json.loads(data)
    except ValueError:
        raise RemoteError(f"the server sent an event that is not JSON: {data[:80]!r}") from None
    if not isinstance(payload, dict):
        raise RemoteError(f"the server sent an event that is not a JSON object: {data[:80]!r}")
    if "error" in payload:
        raise RemoteError(f"the server failed the request: {error_message(payload)}")
    event = Event()
    usage = payload.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        event.prompt_tokens = usage["prompt_tokens"]
    choices = payload.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    text = choice.get("text")
    event.text = text if isinstance(text, str) else ""
    event.finish_reason = choice.get("finish_reason") if isinstance(choice.get("finish_reason"), str) else None
    ids = _ids(choice.get("token_ids"))
    extension = payload.get("moedesk")
    if ids is None and isinstance(extension, dict):
        ids = _ids(extension.get("token_ids"))
        event.all_ids = ids is not None
    event.token_ids = ids
    return event


def _ids(value) -> list[int] | None:
    if isinstance(value, list) and all(type(t) is int for t in value):
        return value
    return None


def error_message(payload) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}} or {"error": "..."}), one line."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    if not isinstance(error, str):
        error = payload.get("message") if isinstance(payload, dict) else None
    return " ".join(str(error or "no message").split())[:300]


def status_error(status: int, body: str, url: str) -> RemoteError:
    """The one line for an HTTP error status from the server at `url`."""
    try:
        message = error_message(json.loads(body))
    except ValueError:
        message = " ".join(body.split())[:200] or "no message"
    if status in (401, 403):
        return RemoteUnavailable(f"the server at {url} refused the API key ({status}): give the key it was started "
                                 f"with (--api-key, or the MOEDESK_REMOTE_API_KEY environment variable)")
    if status == 404 and "model" in message.lower():
        return RemoteError(f"the server at {url} does not serve this model ({message})")
    if status in (502, 503, 504):
        return RemoteUnavailable(f"the server at {url} is unavailable ({status}: {message})")
    return RemoteError(f"the server at {url} answered {status}: {message}")


def finish_reason(reason: str | None) -> str:
    """The engine's finish reason for the server's: "length" when it ran out of tokens, else "stop"."""
    return "length" if reason == "length" else "stop"


def pick_model(served: list[dict], wanted: str) -> tuple[str, str | None]:
    """Which of the served models to ask for: the one named as the local model, else the only one, else the
    first (with a warning line). MoedeskError when the server serves none."""
    ids = [m.get("id") for m in served if isinstance(m, dict) and isinstance(m.get("id"), str)]
    if not ids:
        raise MoedeskError("the server lists no model at /v1/models")
    if wanted in ids:
        return wanted, None
    if len(ids) == 1:
        return ids[0], None
    return ids[0], f"the server serves {len(ids)} models ({', '.join(ids[:4])}); using {ids[0]}"


def served_context(card: dict) -> int | None:
    """The context length a /v1/models entry states: moedesk's and llama-server's context_length, vLLM's and
    SGLang's max_model_len."""
    for key in ("context_length", "max_model_len"):
        value = card.get(key)
        if type(value) is int and value > 0:
            return value
    return None
