"""Prompts the target writes itself, for `moedesk train-draft --self-prompts N`.

A draft head generalises from the prompts it was trained on: the demo's head drafted 3.0 tokens a step on its own
training prompts and 1.9 on unseen ones. A few thousand hand-written prompts cover few of the requests a chat model
meets; the model can write many more, as varied as its own chat data. Fed its chat template up to where a user's
text would start and sampled at temperature 1, an instruction-tuned model writes a plausible user request and ends
the turn itself (the "Magpie" recipe, Xu et al. 2024). Those are prompts in the target's own distribution, made
without any dataset; the target then answers them like the others.

Kept: requests that the model ended itself (a turn cut at the length limit is usually rambling), of at least
MIN_TOKENS tokens, once each (compared without case or spacing), and not already in the given prompt set. They are
saved under the training folder with the settings that made them, so a resumed run reuses them rather than writing
them again (sampled on a GPU, a batch's rounding may differ from run to run).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from moedesk.engine.errors import MoedeskError
from moedesk.training.files import atomic_write

FORMAT = 1
FILE = "self_prompts.jsonl"  # under train.TRAINING_DIR
MAX_TOKENS = 160  # a request longer than this is cut, and so not kept
MIN_TOKENS = 6
TEMPERATURE = 1.0
TOP_P = 0.99
_SENTINEL = "\u2063MOEDESK-USER-TEXT\u2063"


def user_turn_prefix(tokenizer) -> tuple[list[int], tuple[str, ...]]:
    """(token ids of the chat template up to where a user's text starts, stop strings that end the user's turn).
    MoedeskError when the model has no chat template or its template does not place a user's text."""
    text = tokenizer.render_chat([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    at = text.find(_SENTINEL)
    if at < 0:
        raise MoedeskError(f"{tokenizer.source}: its chat template does not show a user's text; --self-prompts "
                           "needs one that does")
    # what the template writes right after the user's text ("<|im_end|>", " [/INST]"): the model writing it ends
    # the request, as its end-of-turn token does when that is an EOS
    after = text[at + len(_SENTINEL):].strip().splitlines()
    stop = (after[0].strip(),) if after and after[0].strip() else ()
    return tokenizer.encode(text[:at], add_special_tokens=False), stop


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().casefold()


def _text(prompt) -> str:
    """What a prompt (load_prompts': raw text or a list of messages) asks, to compare with a written request."""
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def write_prompts(engine, count: int, seed: int = 0, batch_size: int = 32, given=(), progress=None) -> list[list]:
    """Up to `count` requests the target writes itself, each one user turn ([{"role": "user", "content": ...}], as
    load_prompts gives chat prompts), none the same as a `given` prompt, in the order of their seeds. Sampling is
    seeded per request (seed, seed + 1, ...), so the same model writes the same requests whatever the batch. Up to
    four rounds, each asking for what is still missing and half as much again (about a third are dropped); fewer
    than `count` when the model keeps repeating itself."""
    from moedesk.engine.requests import Request, SamplingParams

    if engine.tokenizer is None:
        raise MoedeskError(f"{engine.name}: the model has no tokenizer; --self-prompts needs one")
    prefix, stop = user_turn_prefix(engine.tokenizer)
    seen = {_normal(_text(p)) for p in given}
    kept: list[list] = []
    next_seed = seed
    for _ in range(4):
        missing = count - len(kept)
        if missing <= 0:
            break
        asked = missing + (missing + 1) // 2
        params = [SamplingParams(max_new_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_p=TOP_P, seed=next_seed + i,
                                 stop=stop) for i in range(asked)]
        requests = [Request(prefix, p, tag=i) for i, p in enumerate(params)]
        next_seed += asked
        written: dict[int, object] = {}
        for c in engine.generate(requests, batch_size=batch_size):
            written[c.tag] = c
            if progress:
                progress("self-prompts", len(kept) + len(written), len(kept) + asked, {})
        for i in range(asked):  # in seed order, so which of two repeats is kept does not depend on timing
            c = written[i]
            text = c.text.strip()
            if c.finish_reason != "stop" or len(c.token_ids) < MIN_TOKENS or not text:
                continue
            key = _normal(text)
            if key in seen:
                continue
            seen.add(key)
            kept.append([{"role": "user", "content": text}])
            if len(kept) == count:
                break
    return kept


def settings_key(engine, count: int, seed: int) -> str:
    """What a set of self-written prompts depends on: the model, how many, the seed and how they are sampled."""
    raw = json.dumps([FORMAT, engine.name, engine.config.vocab_size, str(engine.dtype), count, seed, MAX_TOKENS,
                      MIN_TOKENS, TEMPERATURE, TOP_P])
    return hashlib.sha256(raw.encode()).hexdigest()


def load_saved(path: Path, key: str) -> list[list] | None:
    """The prompts saved at `path` for `key`, or None when there are none for it (missing, another key, unreadable:
    the file is written atomically, so a readable header means a whole file)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        head = json.loads(lines[0]) if lines else None
        if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("key") != key:
            return None
        prompts = [json.loads(line)["messages"] for line in lines[1:]]
    except (OSError, ValueError, UnicodeDecodeError, TypeError, KeyError):
        return None
    if len(prompts) != head.get("prompts") or not all(
            isinstance(p, list) and len(p) == 1 and isinstance(p[0], dict) and isinstance(p[0].get("content"), str)
            for p in prompts):
        return None
    return prompts


def self_written_prompts(engine, count: int, seed: int, folder: Path, batch_size: int = 32, given=(), progress=None,
                         log=lambda line: None) -> list[list]:
    """write_prompts, saved in folder/FILE, or the ones saved there before for the same settings."""
    path = Path(folder) / FILE
    key = settings_key(engine, count, seed)
    prompts = load_saved(path, key)
    if prompts is not None:
        log(f"reusing the {len(prompts)} prompts the model wrote in {path}")
        return prompts
    prompts = write_prompts(engine, count, seed, batch_size, given, progress)
    log(f"the model wrote {len(prompts)} prompts of the {count} asked for ({path})")
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"format": FORMAT, "key": key, "prompts": len(prompts)})]
    # after the header, {"messages": [...]} lines as a prompts file has them: easy to read, or to copy into one
    lines += [json.dumps({"messages": p}, ensure_ascii=False) for p in prompts]
    atomic_write(path, lambda tmp: tmp.write_text("\n".join(lines) + "\n", encoding="utf-8"))
    return prompts
