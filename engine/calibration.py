"""Expert popularity: how often the router picks each (layer, expert) on the calibration prompts.

The prompts ship in assets/calibration.txt (never the evaluation sets). They are counted in two
halves, so that engine.popularity can judge how far one half predicts the other; the counts are
cached with the model's profile, so placement is decided once per model and machine.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from engine.json_cache import cached_json
from engine.requests import Request, SamplingParams


def calibration_prompts() -> list[str]:
    text = resources.files("assets").joinpath("calibration.txt").read_text()
    return [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]


def measure_popularity(engine, new_tokens: int = 16) -> list[list[list[int]]]:
    """Route the calibration prompts (chat-formatted when the model has a template) and count selections:
    [counts of the even-numbered prompts, counts of the odd-numbered ones], each [layer][expert]."""
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("popularity needs a tokenizer")
    prompts = [tok.chat_prompt([{"role": "user", "content": p}]) if tok.chat_template else tok.encode(p)
               for p in calibration_prompts()]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    halves = []
    for half in (prompts[0::2], prompts[1::2]):
        engine.executor.selections.clear()
        list(engine.generate([Request(p, params) for p in half], batch_size=4))
        counts = engine.executor.selections
        halves.append([counts[layer].tolist() for layer in sorted(counts)])
    return halves


def cached_popularity(cache_dir: Path, key: str, engine, refresh: bool = False) -> list[list[list[int]]]:
    """The two halves' counts (measure_popularity), measured once per model and machine."""
    return cached_json(Path(cache_dir) / f"popularity-halves-{key}.json", lambda: measure_popularity(engine), refresh)
