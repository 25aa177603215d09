"""What the official openai client sees of a moedesk server's reply, checked alike for each engine behind it."""
from __future__ import annotations


def assert_all_reasoning(client, model: str, messages: list[dict], decode, **options) -> None:
    """A thinking model's reply that never closed its think block: all of it comes back as
    `message.reasoning_content` (the decoded token ids, stripped, not empty) and none as content; streamed, the
    deltas' reasoning_content adds up to the same and their content to nothing."""
    reply = client.chat.completions.create(model=model, messages=messages, **options)
    text = decode(reply.model_extra["moedesk"]["token_ids"]).strip()
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == text and text
    assert message.content == ""
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True, **options))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == text
    assert "".join(d.content or "" for d in deltas) == ""
