"""User settings: one plain dataclass whose fields describe themselves. No Textual here.

Every setting is one line in `Settings`: its type comes from the annotation (``X | None`` means
blank is allowed), and `setting(...)` gives its default, label, help, allowed choices and check.
The settings screen, the JSON file and (later) `moedesk batch` all read `FIELDS`, so a new
feature adds one field and nothing else::

    beams: int = setting(1, "Beams", "...", check=between(1, 64))

The file is ``<config dir>/settings.json`` (see `app.tui.storage.config_dir`), written atomically.
Unknown keys in it are kept on save, so an older moedesk does not erase a newer one's settings.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moedesk.app.tui.storage import atomic_write_json, config_dir, read_json, set_aside
from moedesk.engine.decoding import SPECULATIVE_MODES, Decoding, decoding_options
from moedesk.engine.requests import TEMPERATURE_MAX

SETTINGS_FILE = "settings.json"
# What a blank sampling setting means when the model recommends nothing (Engine.generation_defaults).
SAMPLING_FALLBACKS = {"temperature": 0.7, "top_p": 0.95, "top_k": 0}


def sampling_value(user_value, model_value, fallback):
    """The value a sampling setting takes: the user's, else the model's (Engine.generation_defaults), else ours."""
    if user_value is not None:
        return user_value
    return fallback if model_value is None else model_value

Check = Callable[[Any], "str | None"]  # returns an error message, or None when the value is fine


def readable(number: float) -> str:
    """1000000 as "1,000,000", not "1e+06"; fractions as they are."""
    if float(number).is_integer():
        return f"{int(number):,}"
    return f"{number:g}"


def between(low: float, high: float, *, low_open: bool = False) -> Check:
    def check(value):
        if value < low or (low_open and value == low) or value > high:
            return f"must be {'>' if low_open else '≥'} {readable(low)} and ≤ {readable(high)}"
        return None
    return check


def setting(default, label: str, help: str = "", *, choices: tuple = (), multiline: bool = False,
            check: Check | None = None):
    """A dataclass field that carries what the settings screen and the loader need."""
    meta = {"label": label, "help": help, "choices": tuple(choices), "multiline": multiline, "check": check}
    return dataclasses.field(default=default, metadata=meta)


@dataclass
class Settings:
    system_prompt: str = setting(
        "You are a helpful assistant.", "System prompt",
        "Sent first in every conversation, through the model's chat template. Blank: none.", multiline=True)
    reasoning_effort: str = setting(
        "auto", "Reasoning effort", "How long a model that takes an effort reasons before it answers (gpt-oss: "
                                    "low, medium or high), passed to its chat template; others ignore it. auto: "
                                    "the template's own default.", choices=("auto", "low", "medium", "high"))
    temperature: float | None = setting(
        None, "Temperature", "0 always picks the most likely token (greedy, repeatable); higher is more varied. "
                             "Blank: the model's own default, else 0.7.", check=between(0, TEMPERATURE_MAX))
    top_p: float | None = setting(
        None, "Top-p", "Sample only from the most likely tokens that together hold this much probability. "
                       "Blank: the model's own default, else 0.95.", check=between(0, 1, low_open=True))
    top_k: int | None = setting(
        None, "Top-k", "Sample only from this many most likely tokens; 0 = no limit. Blank: the model's own "
                       "default, else 0.", check=between(0, 1_000_000))
    max_new_tokens: int = setting(
        1024, "Max new tokens", "Longest reply, in tokens.", check=between(1, 1_000_000))
    seed: int | None = setting(
        None, "Seed", "Random seed for sampling. Blank: a new seed for every reply.", check=between(0, 2**63 - 1))
    gpu_budget_gib: float | None = setting(
        None, "GPU budget (GiB)", "All the GPU memory moedesk may use: the model's other weights "
                                  "and one context's KV cache first, experts the rest; 0: every expert in RAM. "
                                  "Blank: decide automatically. Takes effect when a model is loaded.", check=between(0, 100_000))
    dtype: str = setting(
        "auto", "Weights dtype", "What weights are held and computed in (experts too, unless the expert dtype "
                                 "says otherwise). auto: bfloat16 on a GPU, float32 on the CPU. Takes effect when a "
                                 "model is loaded.",
        choices=("auto", "bfloat16", "float16", "float32"))
    expert_dtype: str = setting(
        "auto", "Expert dtype", "How routed experts are kept in memory. auto: as the model file holds them (a "
                                "GGUF's 4-8-bit blocks stay packed); bf16: the weights dtype; int8 / int4: a 16-bit "
                                "model's experts quantised while loading (about a half / a quarter of the memory). "
                                "Takes effect when a model is loaded.",
        choices=("auto", "bf16", "int8", "int4"))
    engine: str = setting(
        "auto", "Engine", "What runs the model. auto: moedesk's own engine where it implements the architecture "
                          "(faster), llama.cpp for the GGUF models it does not (LFM2...); native "
                          "or llama.cpp: that one; remote: the OpenAI-compatible server at the remote URL "
                          "generates (vLLM, SGLang, llama-server, another moedesk serve), the model's files here "
                          "give the tokenizer and chat template. Takes effect when a model is loaded.",
        choices=("auto", "native", "llama.cpp", "remote"))
    # Off by default: llama.cpp waits after every piece of its graph once any eval callback is set, so counting
    # slows every decode step, counted or not (docs/measurements.md, "Session 50").
    expert_counts: bool = setting(
        False, "Count expert picks", "The llama.cpp engine counts which experts its routers pick (prompts, and a "
                                     "sample of the decode steps) for the stats panel's heat map. That slows every "
                                     "decode step a little. Off: faster replies; the heat map shows where experts "
                                     "sit, not which were picked. moedesk's own engine counts at no cost either "
                                     "way. Takes effect when a model is loaded.")
    remote_url: str = setting(
        "", "Remote URL", "The server the remote engine sends requests to, e.g. http://gpu-box:8000. Takes effect "
                          "when a model is loaded.")
    remote_api_key: str = setting(
        "", "Remote API key", "The remote server's API key. Blank: the MOEDESK_REMOTE_API_KEY environment "
                              "variable, else none. Kept in the settings file as it is typed.")
    speculative: str = setting(
        "off", "Speculative decoding", "A small draft head guesses the next tokens and the model checks them all in "
                                       "one step: the same reply (token for token at temperature 0), sooner when "
                                       "the guesses are good. greedy: a chain of guesses; beam: a tree of them "
                                       "(draft width per step); auto: only where this machine's measured step "
                                       "times say it pays, plain decoding elsewhere. Needs a draft head.",
        choices=SPECULATIVE_MODES)
    draft: str = setting(
        "", "Draft head", "Folder of an EAGLE draft head for the loaded model (config.json and its weights; "
                          "`moedesk train-draft` makes one). Blank: the model's own, where it has one (the demo).")
    draft_length: int = setting(
        4, "Draft length", "Tokens guessed per step (the tree's depth in beam mode, auto's longest).",
        check=between(1, 16))
    draft_width: int = setting(
        4, "Draft width", "Beam mode: guesses per position; the tree keeps length × width of them.",
        check=between(1, 16))
    beams: int = setting(
        1, "Beams", "Above 1: beam search over this many hypotheses instead of sampling (and of speculative "
                    "decoding). Only the best hypothesis is shown, whole, when the search ends: nothing streams "
                    "before.", check=between(1, 64))
    length_penalty: float = setting(
        1.0, "Length penalty", "Beam search ranks hypotheses by their log-probability / length ** this, as "
                               "transformers does: above 1 favours longer replies, below 1 shorter ones.",
        check=between(-10, 10))

    def template_options(self) -> dict:
        """The chat template's own switches these settings set (engine.load.tokenizer's render_chat options)."""
        return {} if self.reasoning_effort == "auto" else {"reasoning_effort": self.reasoning_effort}

    def decoding(self, engine):
        """How the engine decodes a reply (Engine.stream's `decoding`): beam search when beams > 1, speculative
        decoding when it is on, else None (plain sampling). Raises MoedeskError (one line) when speculation is
        asked for and no draft head is set or known for `engine`'s model."""
        draft = str(Path(self.draft.strip()).expanduser()) if self.draft.strip() else None
        return decoding_options(engine, Decoding(self.speculative, draft, self.draft_length, self.draft_width,
                                                 self.beams, self.length_penalty))

    def sampling_params(self, seed: int | None = None, model_defaults: dict | None = None, **overrides):
        """The engine's SamplingParams for one reply; `seed` is used when the settings leave it blank, and
        `model_defaults` (Engine.generation_defaults) where a sampling value is blank."""
        from moedesk.engine.requests import SamplingParams

        chosen = self.seed if self.seed is not None else (seed or 0)
        sampling = {name: sampling_value(getattr(self, name), (model_defaults or {}).get(name), fallback)
                    for name, fallback in SAMPLING_FALLBACKS.items()}
        return SamplingParams(**{"max_new_tokens": self.max_new_tokens, **sampling, "seed": chosen, **overrides})

    @property
    def engine_dtype(self) -> str | None:
        """`dtype` as `Engine.load` takes it: None (the device's own default) for auto."""
        return None if self.dtype == "auto" else self.dtype

    @property
    def engine_expert_dtype(self) -> str | None:
        """`expert_dtype` for `moedesk batch`'s defaults: None for auto, as if unset."""
        return None if self.expert_dtype == "auto" else self.expert_dtype

    def load_options(self) -> dict:
        """The settings that shape a model load, as `Engine.load` takes them."""
        remote = {"url": self.remote_url.strip() or None, "api_key": self.remote_api_key.strip() or None}
        return {"gpu_budget": self.gpu_budget_gib, "dtype": self.engine_dtype, "expert_dtype": self.expert_dtype,
                "engine": self.engine, "count_experts": self.expert_counts,
                **(remote if self.engine == "remote" else {})}

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in FIELDS}

    def problems(self) -> dict[str, str]:
        """Field name -> what is wrong with its value; empty when every value is acceptable."""
        out = {}
        for f in FIELDS:
            try:
                f.coerce(getattr(self, f.name))
            except ValueError as e:
                out[f.name] = str(e)
        return out

    @classmethod
    def from_dict(cls, data: dict, problems: list[str] | None = None) -> "Settings":
        """Settings from a JSON object; a missing or invalid value falls back to its default (noted in problems)."""
        values = {}
        for f in FIELDS:
            if f.name not in data:
                continue
            try:
                values[f.name] = f.coerce(data[f.name])
            except ValueError as e:
                if problems is not None:
                    problems.append(f"{f.name}: {e}; using {f.format(f.default) or 'blank'}")
        return cls(**values)


@dataclass(frozen=True)
class SettingField:
    """One setting as the settings screen sees it."""

    name: str
    label: str
    help: str
    type: type  # bool, int, float or str
    optional: bool  # blank (None) allowed
    default: Any
    choices: tuple = ()
    multiline: bool = False
    check: Check | None = None

    @property
    def kind(self) -> str:
        """How to edit it: 'bool', 'choice', 'text' (several lines), 'str', 'int' or 'float'."""
        if self.type is bool:
            return "bool"
        if self.choices:
            return "choice"
        if self.type is str:
            return "text" if self.multiline else "str"
        return self.type.__name__

    def parse(self, raw: str) -> Any:
        """The value a person typed; ValueError with a short message when it is not acceptable."""
        if self.type is str:
            return self.coerce(raw)
        raw = raw.strip()
        if raw == "":
            if self.optional:
                return None
            raise ValueError("required")
        if self.type is bool:
            lowered = raw.lower()
            if lowered not in ("true", "false", "yes", "no", "on", "off", "1", "0"):
                raise ValueError("must be yes or no")
            return self.coerce(lowered in ("true", "yes", "on", "1"))
        try:
            value = self.type(raw)
        except ValueError:
            raise ValueError("must be a whole number" if self.type is int else "must be a number") from None
        return self.coerce(value)

    def coerce(self, value: Any) -> Any:
        """A value read from JSON (or parsed), converted and checked; ValueError when it is not acceptable."""
        if value is None:
            if self.optional:
                return None
            raise ValueError("required")
        if self.type is bool:
            if not isinstance(value, bool):
                raise ValueError("must be true or false")
        elif self.type is int:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
                raise ValueError("must be a whole number")
            value = int(value)
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError("must be a number")
            value = float(value)
        elif self.type is str:
            if not isinstance(value, str):
                raise ValueError("must be text")
        if self.choices and value not in self.choices:
            raise ValueError(f"must be one of {', '.join(map(str, self.choices))}")
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise ValueError(problem)
        return value

    def format(self, value: Any) -> str:
        """The text an input box shows for a value."""
        if value is None:
            return ""
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, float):
            return f"{value:g}" if abs(value) < 1e15 else repr(value)
        return str(value)


def _fields() -> tuple[SettingField, ...]:
    hints = typing.get_type_hints(Settings)
    out = []
    for f in dataclasses.fields(Settings):
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = (typing.get_origin(hint) in (typing.Union, types.UnionType)) and type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else hint
        if base not in (bool, int, float, str):
            raise TypeError(f"Settings.{f.name}: unsupported type {hint}")
        meta = f.metadata
        out.append(SettingField(f.name, meta.get("label", f.name), meta.get("help", ""), base, optional, f.default,
                                meta.get("choices", ()), meta.get("multiline", False), meta.get("check")))
    return tuple(out)


FIELDS: tuple[SettingField, ...] = _fields()
FIELDS_BY_NAME: dict[str, SettingField] = {f.name: f for f in FIELDS}


def settings_path() -> Path:
    return config_dir() / SETTINGS_FILE


def load_settings(path: Path | None = None, problems: list[str] | None = None) -> Settings:
    """The saved settings; defaults when there is no file. A bad file or value is noted in `problems`, not raised."""
    path = Path(path) if path is not None else settings_path()
    try:
        data = read_json(path)
    except FileNotFoundError:
        return Settings()
    except (OSError, ValueError) as e:
        if problems is not None:
            problems.append(f"{path}: unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                            f"using defaults")
        return Settings()
    if not isinstance(data, dict):
        if problems is not None:
            problems.append(f"{path}: expected a JSON object; using defaults")
        return Settings()
    return Settings.from_dict(data, problems)


def save_settings(settings: Settings, path: Path | None = None, problems: list[str] | None = None) -> Path:
    """Write the settings atomically, keeping keys this version does not know. A file there that is not a JSON
    object (a hand edit gone wrong) is set aside first, not written over; `problems` gets a line saying where."""
    path = Path(path) if path is not None else settings_path()
    try:
        existing = read_json(path)
    except FileNotFoundError:
        existing = {}
    except (OSError, ValueError):
        existing = None
    if not isinstance(existing, dict):
        existing = {}
        if path.exists():
            kept = set_aside(path)  # OSError: nothing is written, the caller says it could not save
            if problems is not None:
                problems.append(f"{path.name} could not be read, so it is kept as {kept.name}")
    data = dict(existing)
    data.update(settings.to_dict())
    atomic_write_json(path, data)
    return path
