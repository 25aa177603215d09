"""What the train-draft tests share: chat prompts written here (never taken from an evaluation set) and their
file, a head's loss figures before and after training, and the check that speculation with a trained head is
plain greedy decoding token for token."""
import json

import torch

from moedesk.engine.requests import Request, SamplingParams
from moedesk.training import train as T

PROMPTS = ["Hello, world!", "Tell me about the quick brown fox.", "def add(a, b):", "How do experts route tokens?",
           "Write a list of numbers.", "What is 2 + 3?"]


def write_prompts(path, extra=(), texts=PROMPTS):
    """`texts` (default PROMPTS) as train-draft's JSONL (one chat per line), then the records in `extra` as they are."""
    lines = [{"messages": [{"role": "user", "content": p}]} for p in texts] + list(extra)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def figures_before_and_after_training(engine, head, data, settings) -> tuple[dict, dict]:
    """batch_losses' figures over every sequence of `data`, before and after T.train with `settings`."""
    head.embed = engine.model.embed.weight.detach().float()
    lm = engine.model.lm_head.weight.detach()
    batch = list(range(data.sequences))

    def figures():
        with torch.no_grad():
            return T.batch_losses(head, lm, data, batch, settings, None, "cpu")[1]

    before = figures()
    T.train(head, lm, data, settings, checkpoint=None)
    return before, figures()


def assert_speculation_is_plain_greedy(engine, draft) -> None:
    """Chains and trees drafted by the head in folder `draft` give plain greedy's tokens (first 3 PROMPTS)."""
    params = SamplingParams(max_new_tokens=16, temperature=0)
    requests = [Request(engine.tokenizer.chat_prompt([{"role": "user", "content": p}]), params, tag=i)
                for i, p in enumerate(PROMPTS[:3])]
    plain = [next(iter(engine.generate([r], batch_size=1))).token_ids for r in requests]
    for mode in ("greedy", "beam"):
        out = engine.speculate(requests, draft, mode=mode, draft_length=3, draft_width=2)
        assert [c.token_ids for c in out] == plain, mode
