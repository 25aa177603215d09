"""The demo's own GGUF through `--engine llama.cpp`: llama-cpp-python's own generation is the reference."""
from __future__ import annotations

import pytest

from moedesk.engine.requests import Request, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "Mixture of experts models"]
TOKENS = 24


def test_greedy_text_equals_llama_cpp_pythons_high_level_generation(demo_llama, demo_reference):
    assert demo_llama.kind == "llama.cpp" and "llama.cpp" in demo_llama.why
    requests = [Request(demo_llama.tokenizer.encode(p), SamplingParams(max_new_tokens=TOKENS, temperature=0))
                for p in PROMPTS]
    ours = demo_llama.complete(requests)  # together: one llama_batch of 4 sequences a step
    assert all(c.stats["mean_batch"] > 1 for c in ours[:1])
    for prompt, request, completion in zip(PROMPTS, requests, ours):
        assert request.prompt_ids == demo_reference.tokenize(prompt.encode(), add_bos=True, special=True)
        demo_reference.reset()
        reference = demo_reference.create_completion(prompt, max_tokens=TOKENS, temperature=0.0, repeat_penalty=1.0)
        assert completion.text == reference["choices"][0]["text"], prompt
        assert len(completion.token_ids) == reference["usage"]["completion_tokens"]


def test_one_at_a_time_equals_together(demo_llama):
    requests = [Request(demo_llama.tokenizer.encode(p), SamplingParams(max_new_tokens=12, temperature=0))
                for p in PROMPTS[:3]]
    together = [c.token_ids for c in demo_llama.complete(requests)]
    alone = [demo_llama.complete([r])[0].token_ids for r in requests]
    assert together == alone


def test_streaming_cancel_and_seeded_sampling(demo_llama):
    import threading

    ids = demo_llama.tokenizer.chat_prompt([{"role": "user", "content": "Name three colours."}])
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=40, seed=7)
    first = "".join(chunk.text for chunk in demo_llama.stream(ids, params))
    assert first == "".join(chunk.text for chunk in demo_llama.stream(ids, params))  # a seed repeats itself
    cancel = threading.Event()
    chunks = []
    for chunk in demo_llama.stream(ids, SamplingParams(max_new_tokens=64, temperature=0), cancel=cancel):
        chunks.append(chunk)
        if len(chunks) == 3:
            cancel.set()
    assert chunks[-1].completion.finish_reason == "cancelled" and len(chunks[-1].completion.token_ids) <= 4


def test_stop_strings_and_structured_output(demo_llama):
    import json

    ids = demo_llama.tokenizer.encode("The capital of France is")
    stopped = demo_llama.complete([Request(ids, SamplingParams(max_new_tokens=24, temperature=0, stop=("."),))])[0]
    assert stopped.finish_reason == "stop" and "." not in stopped.text
    chat = demo_llama.tokenizer.chat_prompt([{"role": "user", "content": "Give me a JSON object with a name."}])
    grammar = demo_llama.grammar({"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
        "additionalProperties": False}}})
    reply = demo_llama.complete([Request(chat, SamplingParams(max_new_tokens=40, temperature=0), grammar=grammar)])[0]
    assert list(json.loads(reply.text)) == ["name"] and reply.finish_reason == "stop"


def test_beam_search_and_speculation_are_one_line_native_features(demo_llama):
    from moedesk.engine.errors import MoedeskError
    from moedesk.engine.generation.beam import BeamOptions

    ids = demo_llama.tokenizer.encode("Hello")
    with pytest.raises(MoedeskError, match="beam search is a native-engine feature"):
        demo_llama.complete([Request(ids)], decoding=BeamOptions(2))
    with pytest.raises(MoedeskError, match="native-engine feature"):
        demo_llama.load_draft("somewhere")


def test_the_kv_cache_reserve_is_sized_from_the_header_as_the_loaded_model_states_it(demo_llama):
    from moedesk.engine.llamacpp.fit import gguf_shape, read_header

    # SmolLM2-135M: 30 layers, 3 key/value heads of 64, f16 keys and values
    shape = gguf_shape(read_header(demo_llama.path))
    assert shape.layers == 30 and shape.kv_per_position == 2 * 30 * 3 * (64 + 64)
    assert demo_llama.cache.bytes_per_position() == 2 * 30 * 3 * (64 + 64)
