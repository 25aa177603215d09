"""The shipped prompt set that `moedesk train-draft` trains draft heads on (assets/draft_prompts.jsonl): it parses with
train-draft's own loader, holds at least 2,000 prompts, no two alike after normalising case, whitespace and
punctuation, each with a non-empty user message, and none sharing a run of 8 consecutive normalised words with an
MT-bench question turn or a HumanEval prompt, so that evaluation text never leaks into training. That last check reads
the evaluation sets (mt_bench_questions.jsonl, humaneval.jsonl) from the folder MOEDESK_EVAL_DATA names, where they
are kept apart from the repository, and is skipped where it is not set, as in CI; the others always run. CPU only,
fast."""

import json
import os
import re
from pathlib import Path

import pytest

from moedesk.training.train import default_prompts_path, load_prompts

EVAL_DATA = Path(os.environ["MOEDESK_EVAL_DATA"]) if os.environ.get("MOEDESK_EVAL_DATA") else None
NGRAM = 8


def _words(text):
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def _normalised(text):
    return " ".join(_words(text))


def _ngrams(text, n=NGRAM):
    w = _words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def _text(prompt):
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m["content"] for m in prompt)


@pytest.fixture(scope="module")
def prompts():
    return load_prompts(default_prompts_path())


def test_at_least_two_thousand_prompts(prompts):
    assert len(prompts) >= 2000


def test_every_item_is_a_non_empty_user_message(prompts):
    for p in prompts:
        assert isinstance(p, list) and p, p
        assert any(m["role"] == "user" and m["content"].strip() for m in p), p


def test_every_line_has_a_category_and_messages():
    for number, line in enumerate(default_prompts_path().read_text(encoding="utf-8").splitlines(), 1):
        item = json.loads(line)
        assert isinstance(item.get("category"), str) and item["category"], number
        assert set(item) == {"category", "messages"}, number


def test_no_two_prompts_alike_after_normalising(prompts):
    seen = {}
    for i, p in enumerate(prompts):
        key = _normalised(_text(p))
        assert key, i
        assert key not in seen, f"prompt {i} repeats prompt {seen[key]}: {key[:80]!r}"
        seen[key] = i


def _evaluation_ngrams():
    if EVAL_DATA is None:
        pytest.skip("MOEDESK_EVAL_DATA (the folder of the evaluation sets) is not set, as in CI")
    mt_bench, humaneval = EVAL_DATA / "mt_bench_questions.jsonl", EVAL_DATA / "humaneval.jsonl"
    if not (mt_bench.is_file() and humaneval.is_file()):
        pytest.fail(f"{EVAL_DATA}: MOEDESK_EVAL_DATA names no folder with mt_bench_questions.jsonl and humaneval.jsonl")
    grams = {}
    for line in mt_bench.read_text(encoding="utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            for turn in q["turns"]:
                for g in _ngrams(turn):
                    grams.setdefault(g, f"MT-bench {q['question_id']}")
    for line in humaneval.read_text(encoding="utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            for g in _ngrams(q["prompt"]):
                grams.setdefault(g, q["task_id"])
    assert grams
    return grams


def test_no_prompt_shares_eight_words_with_mt_bench_or_humaneval(prompts):
    grams = _evaluation_ngrams()
    hits = []
    for i, p in enumerate(prompts):
        for g in _ngrams(_text(p)):
            if g in grams:
                hits.append(f"prompt {i} shares {' '.join(g)!r} with {grams[g]}")
    assert not hits, "\n".join(hits[:20])
