"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling."""
from __future__ import annotations

import torch

from engine.requests import SamplingParams


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from a row of float32 logits [V] on the CPU.

    Sampling happens on the CPU with the sequence's own generator, so a seed gives the same
    text whatever the device and whatever else shares the batch.
    """
    if params.temperature == 0:
        return int(torch.argmax(logits))
    # Shifted so the largest logit is 0 before dividing: a temperature as small as 1e-45 then sends
    # the others to -inf (greedy, as its limit is) instead of everything to inf and the softmax to NaN.
    # NaN logits (a model gone wrong) count as -inf, +inf as the largest finite value.
    logits = torch.nan_to_num(logits.float(), nan=float("-inf"), neginf=float("-inf"))
    logits = (logits - logits.max()) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the ones before it already cover top_p; the first always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if not torch.isfinite(probs).all():  # every logit NaN or -inf: nothing to weigh, take the argmax
        return int(torch.argmax(logits))
    return int(torch.multinomial(probs, 1, generator=generator))
