"""A model's own sampling defaults: what its authors recommend, applied where the user set no value.

Read from a checkpoint folder's generation_config.json (as transformers writes it: `do_sample: false` is greedy),
a GGUF's `general.sampling.*` metadata (as llama.cpp's converter writes it), or the demo's recipe. Only the values
moedesk samples with are kept: temperature, top_p and top_k (0: off). A value out of range is left out, so a bad
file falls back to the front end's own default rather than failing the load.
"""
from __future__ import annotations

import math

SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def checked(values: dict) -> dict:
    """The keys of SAMPLING_KEYS in `values` whose values are usable, as float / int."""
    out = {}
    temperature = values.get("temperature")
    if _number(temperature) and 0 <= temperature <= 5:
        out["temperature"] = float(temperature)
    top_p = values.get("top_p")
    if _number(top_p) and 0 < top_p <= 1:
        out["top_p"] = float(top_p)
    top_k = values.get("top_k")
    if _number(top_k) and top_k == int(top_k):
        out["top_k"] = max(0, int(top_k))  # llama.cpp writes -1 for "off", as transformers' 0
    return out


def from_generation_config(config: dict) -> dict:
    """transformers' generation_config.json. do_sample false means greedy whatever temperature says; without
    do_sample only the values written apply (a config holding just token ids says nothing about sampling)."""
    if not isinstance(config, dict):
        return {}
    values = checked(config)
    if config.get("do_sample") is False:
        values = {"temperature": 0.0}
    return values


def from_gguf_metadata(get) -> dict:
    """`get(key)`: a GGUF metadata value or None. llama.cpp's keys: general.sampling.temp, .top_p, .top_k."""
    return checked({"temperature": get("general.sampling.temp"), "top_p": get("general.sampling.top_p"),
                    "top_k": get("general.sampling.top_k")})


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
