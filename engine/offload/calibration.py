"""Expert popularity: how often the router picks each (layer, expert) on the calibration prompts.

The prompts ship in assets/calibration.txt (never the evaluation sets). They are counted in two
halves, so that engine.offload.popularity can judge how far one half predicts the other; the counts are
cached with the model's profile, so placement is decided once per model and machine.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Callable

from moedesk.engine.json_cache import cached_json
from moedesk.engine.requests import Request, SamplingParams


def calibration_prompts() -> list[str]:
    text = resources.files("moedesk.assets").joinpath("calibration.txt").read_text()
    return [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]


# route(requests) runs them to their end and returns the routers' selection counts for them, {layer: [expert]}:
# the engine's generation, handed down so that calibration need not know the engine.
Route = Callable[[list[Request]], dict]


def measure_popularity(tokenizer, route: Route, new_tokens: int = 16) -> list[list[list[int]]]:
    """Route the calibration prompts (chat-formatted when the model has a template) and count selections:
    [counts of the even-numbered prompts, counts of the odd-numbered ones], each [layer][expert]."""
    tok = tokenizer
    if tok is None:
        raise ValueError("popularity needs a tokenizer")
    prompts = [tok.chat_prompt([{"role": "user", "content": p}]) if tok.chat_template else tok.encode(p)
               for p in calibration_prompts()]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    halves = []
    for half in (prompts[0::2], prompts[1::2]):
        counts = route([Request(p, params) for p in half])
        halves.append([counts[layer].tolist() for layer in sorted(counts)])
    return halves


def cached_popularity(cache_dir: Path, key: str, tokenizer, route: Route, experts_per_layer: list[int],
                      refresh: bool = False) -> list[list[list[int]]]:
    """The two halves' counts (measure_popularity), measured once per model and machine; a stored file that
    does not fit this model (edited, or from another version) is measured again."""
    path = Path(cache_dir) / f"popularity-halves-{key}.json"
    halves = cached_json(path, lambda: measure_popularity(tokenizer, route), refresh)
    if not _fits(halves, experts_per_layer):
        halves = cached_json(path, lambda: measure_popularity(tokenizer, route), refresh=True)
    return halves


def _fits(halves, experts_per_layer: list[int]) -> bool:
    return (isinstance(halves, list) and len(halves) == 2
            and all(isinstance(h, list) and [len(row) if isinstance(row, list) else -1 for row in h] == experts_per_layer
                    and all(isinstance(n, int) and n >= 0 for row in h for n in row) for h in halves))
