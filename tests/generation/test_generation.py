"""Sampling, stop conditions, streaming and chat templates on a tiny real model."""
import threading

import pytest
import torch

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from moedesk.engine.generation.sampling import sample_token, sample_tokens, sampling_probs
from tests.tiny_models import CHAT_TEMPLATE


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.load(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32")


def complete(engine, prompt, batch_size=4, **params):
    ids = engine.tokenizer.encode(prompt)
    return next(engine.generate([Request(ids, SamplingParams(**params))], batch_size=batch_size))


def test_seeded_sampling_is_reproducible_and_independent_of_batch(engine):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    alone = complete(engine, "The quick brown fox", temperature=1.0, top_p=0.9, seed=7, max_new_tokens=16)
    ids = engine.tokenizer.encode("The quick brown fox")
    others = [Request(engine.tokenizer.encode("Hello"), SamplingParams(max_new_tokens=9, temperature=1.0, seed=s), tag=s)
              for s in range(3)]
    batch = {c.tag: c for c in engine.generate(others + [Request(ids, params, tag="me")], batch_size=4)}
    assert batch["me"].token_ids == alone.token_ids
    other_seed = complete(engine, "The quick brown fox", temperature=1.0, top_p=0.9, seed=8, max_new_tokens=16)
    assert other_seed.token_ids != alone.token_ids


def test_sampler_respects_top_k_and_top_p():
    logits = torch.tensor([5.0, 4.0, 1.0, 0.0, -1.0])
    g = torch.Generator().manual_seed(0)
    seen_k = {sample_token(logits, SamplingParams(temperature=5.0, top_k=2), g) for _ in range(300)}
    assert seen_k == {0, 1}
    seen_p = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.5), g) for _ in range(300)}
    assert seen_p == {0}  # token 0 alone holds > 50% of the mass
    assert sample_token(logits, SamplingParams(temperature=0), None) == 0


MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.6),
         SamplingParams(temperature=2.0, top_k=3), SamplingParams(temperature=0.7),
         SamplingParams(temperature=1.3, top_k=4, top_p=0.8)]


def test_batched_sampler_draws_each_row_as_it_would_alone():
    """sample_tokens over a batch of rows with mixed settings gives every row the token it gets sampled alone with
    the same generator state: a row's draw does not depend on what shares its batch."""
    logits = torch.randn(len(MIXED), 50, generator=torch.Generator().manual_seed(3)) * 3
    for seed in range(20):
        together = sample_tokens(logits, MIXED, [torch.Generator().manual_seed(seed + i) for i in range(len(MIXED))])
        alone = [sample_token(logits[i], p, torch.Generator().manual_seed(seed + i)) for i, p in enumerate(MIXED)]
        assert together == alone
        assert together[0] == int(logits[0].argmax())


def test_batched_sampler_follows_its_distribution():
    """Draws of each row match sampling_probs (chi-square, false alarm 1e-4 per row), and sampling_probs applies
    temperature, top-k and top-p as their definitions say on logits worked by hand."""
    from scipy.stats import chisquare

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(len(MIXED) - 1, -1)
    params = MIXED[1:]
    probs = sampling_probs(logits, params)
    # top_p 0.6 at T=1: softmax is .53, .20, .12, .07, .03, .00: the first two cover 0.6
    assert (probs[0] > 0).tolist() == [True, True, False, False, False, False]
    assert (probs[1] > 0).sum() == 3  # top_k 3
    expected = torch.softmax(logits[2] / 0.7, -1)
    assert torch.allclose(probs[2], expected, atol=1e-6)
    g = [torch.Generator().manual_seed(100 + i) for i in range(len(params))]
    n = 4000
    counts = torch.zeros_like(probs)
    for _ in range(n):
        for i, t in enumerate(sample_tokens(logits, params, g)):
            counts[i, t] += 1
    for i in range(len(params)):
        keep = probs[i] > 0
        assert counts[i][~keep].sum() == 0
        assert chisquare(counts[i][keep].numpy(), (probs[i][keep] * n).numpy()).pvalue > 1e-4


def test_max_tokens_and_ignore_eos(engine):
    c = complete(engine, "Hello", temperature=0, max_new_tokens=5, ignore_eos=True)
    assert len(c.token_ids) == 5 and c.finish_reason == "length"


def test_eos_stops_generation(engine, monkeypatch):
    greedy = complete(engine, "Hello", temperature=0, max_new_tokens=12, ignore_eos=True)
    first = greedy.token_ids[3]
    monkeypatch.setattr(engine.runner, "stop_ids", frozenset({first}))
    stopped = complete(engine, "Hello", temperature=0, max_new_tokens=12)
    cut = greedy.token_ids.index(first)
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy.token_ids[:cut]


def test_stop_string_truncates_text(engine):
    full = complete(engine, "The quick", temperature=0, max_new_tokens=16, ignore_eos=True)
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip(), "the tiny model should produce some text"
    cut = complete(engine, "The quick", temperature=0, max_new_tokens=16, ignore_eos=True, stop=(stop,))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]


def test_context_limit_ends_with_length(tiny_checkpoint):
    small = Engine.load(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32", context_length=12)
    ids = small.tokenizer.encode("The quick brown fox")
    params = SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True)
    c = next(small.generate([Request(ids, params)]))
    assert c.finish_reason == "length" and len(ids) + len(c.token_ids) == 12  # not one past it
    assert list(small.stream(ids, params))[-1].completion.token_ids == c.token_ids


def test_stream_yields_the_same_text_as_generate(engine):
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    ids = engine.tokenizer.encode("def add(a, b):")
    chunks = list(engine.stream(ids, params))
    whole = next(engine.generate([Request(ids, params)]))
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert chunks[-1].completion is not None and all(c.completion is None for c in chunks[:-1])


def test_streaming_and_stop_checks_decode_each_token_once(engine, monkeypatch):
    """Text grows token by token: the whole reply is decoded once, for the completion, not after every token."""
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, stop=("never appears \u2603",))
    ids = engine.tokenizer.encode("The quick brown fox")
    whole = next(engine.generate([Request(ids, params)]))
    decode, calls = engine.tokenizer.decode, []
    monkeypatch.setattr(engine.tokenizer, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    chunks = list(engine.stream(ids, params))
    assert "".join(c.text for c in chunks) == whole.text and len(whole.token_ids) == 40
    assert len(calls) <= 1


def test_stop_string_found_across_token_boundaries(engine):
    """A stop string that a later token completes ends the text where it starts."""
    full = complete(engine, "The quick", temperature=0, max_new_tokens=24, ignore_eos=True)
    for start in range(0, len(full.text) - 4, 3):
        stop = full.text[start:start + 4]
        if not stop.strip():
            continue
        cut = complete(engine, "The quick", temperature=0, max_new_tokens=24, ignore_eos=True, stop=(stop, "zzzzzzzz"))
        assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)], stop


def test_stream_cancel(engine):
    cancel = threading.Event()
    got = []
    for chunk in engine.stream(engine.tokenizer.encode("Hello"), SamplingParams(max_new_tokens=200, temperature=0,
                                                                             ignore_eos=True), cancel):
        got.append(chunk)
        if len(got) == 3:
            cancel.set()
    assert got[-1].completion.finish_reason == "cancelled"
    assert len(got[-1].completion.token_ids) == 3


def test_chat_template_matches_transformers(engine, tiny_checkpoint):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_checkpoint("qwen3_moe")))
    hf.chat_template = CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, fox!"}]
    assert engine.tokenizer.chat_prompt(messages) == hf.apply_chat_template(messages, add_generation_prompt=True,
                                                                            tokenize=True, return_dict=False)

