"""What the llama.cpp engine's loop does besides llama_decode (issue 40: its decode at >= 0.95x llama-bench).

Between two llama_decode calls a greedy step runs no torch op (a torch CPU op may start torch's OpenMP team beside
llama.cpp's threads), and a prompt that fits the context's batch is one llama_decode with one row of logits, as
llama-bench's prompt is.
"""
import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from moedesk.engine.llamacpp.decoder import greedy_tokens
from moedesk.engine.requests import Request, SamplingParams


class _TorchCalls(TorchFunctionMode):
    """Every torch function called on this thread while active."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


class _Counting:
    """The real ctypes API, with each llama_decode's tokens and rows of logits asked for kept."""

    def __init__(self, api):
        self._api, self.decodes = api, []

    def __getattr__(self, name):
        return getattr(self._api, name)

    def llama_decode(self, ctx, batch):
        self.decodes.append((batch.n_tokens, sum(bool(batch.logits[i]) for i in range(batch.n_tokens))))
        return self._api.llama_decode(ctx, batch)


def test_greedy_decode_steps_run_no_torch_op(demo_llama):
    engine = demo_llama
    prompt = engine.tokenizer.encode("The capital of France is")
    expected = engine.complete([Request(prompt, SamplingParams(max_new_tokens=6, temperature=0,
                                                               ignore_eos=True))])[0].token_ids
    decoder = engine._decoder()
    seq = decoder.start(Request(prompt, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)), 0)
    with _TorchCalls() as mode:
        list(decoder.prefill([seq]))
        while not seq.finish_reason:
            list(decoder.decode([seq]))
    assert mode.calls == []
    assert seq.tokens == expected  # the scheduler's own run chose the same tokens


def test_sampled_rows_still_sample_through_torch(demo_llama):
    engine = demo_llama
    decoder = engine._decoder()
    seq = decoder.start(Request(engine.tokenizer.encode("Once upon a time"),
                                SamplingParams(max_new_tokens=3, temperature=0.8, seed=7, ignore_eos=True)), 0)
    with _TorchCalls() as mode:
        list(decoder.prefill([seq]))
        while not seq.finish_reason:
            list(decoder.decode([seq]))
    assert len(seq.tokens) == 3 and "argmax" in mode.calls  # sample_tokens ran


def test_a_prompt_within_the_batch_is_one_llama_decode_with_one_logits_row(demo_llama, monkeypatch):
    engine = demo_llama
    api = _Counting(engine.llama.api)
    monkeypatch.setattr(engine.llama, "api", api)
    length = min(engine.llama.batch_tokens, engine.context_length - 8)
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, engine.vocab_size - 100, length)]
    engine.complete([Request(prompt, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))])
    # the prompt whole, its last token's logits alone; then one token a step
    assert api.decodes == [(length, 1), (1, 1), (1, 1)]


def test_greedy_tokens_break_ties_and_nan_as_torch_argmax():
    rows = np.array([[0.0, 2.0, 2.0, -1.0], [1.0, np.nan, 3.0, np.nan], [-np.inf] * 4], dtype=np.float32)
    assert greedy_tokens(rows) == torch.argmax(torch.from_numpy(rows), dim=-1).tolist() == [1, 1, 0]
