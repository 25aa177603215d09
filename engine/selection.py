"""Which engine runs a model: the native one where it implements the architecture, llama.cpp otherwise.

`choose_engine` decides (reading at most the checkpoint's header) and says why in one line, which the app shows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moedesk.engine.errors import MoedeskError, UnsupportedModelError
from moedesk.engine.load.checkpoint import model_path  # noqa: F401 -- where a model's files are, for front ends

ENGINES = ("auto", "native", "llama.cpp")


@dataclass(frozen=True)
class Choice:
    kind: str  # "native" | "llama.cpp"; "none" from listed_engine: the setting would not load it
    model: str  # what that engine loads: for llama.cpp a GGUF path ("demo" is its source GGUF)
    why: str


def choose_engine(model: str, requested: str = "auto", llama_cpp_problem=None) -> Choice | None:
    """The engine asked for: a Choice, or None for auto (the native engine is tried first, and `after_refusal`
    decides when it refuses the model). llama_cpp_problem() gives None when llama.cpp can run, else its one
    line (engine.llamacpp.library.available; asked only when llama.cpp is wanted). Raises MoedeskError (one
    line) when the requested engine cannot run the model."""
    if requested not in ENGINES:
        raise MoedeskError(f"--engine {requested}: choose one of {', '.join(ENGINES)}")
    if requested == "auto":
        return None
    if requested == "native":
        return Choice("native", model, "native engine, as asked")
    path = _gguf_for_llama_cpp(model)
    problem = (llama_cpp_problem or _llama_cpp_problem)()
    if problem:
        raise MoedeskError(problem)
    return Choice("llama.cpp", path, "llama.cpp engine, as asked")


def after_refusal(error: UnsupportedModelError, llama_cpp_problem=None) -> Choice:
    """auto, once the native engine refused a model (an architecture or variant it does not implement): llama.cpp
    for a GGUF file; otherwise the refusal again, saying what would run it."""
    path = str(error.path)
    if not path.endswith(".gguf"):
        raise UnsupportedModelError(error.path, not_gguf("auto", error.problem)) from None
    problem = (llama_cpp_problem or _llama_cpp_problem)()
    if problem:
        raise UnsupportedModelError(error.path, f"{error.problem}, and {problem}") from None
    return Choice("llama.cpp", path, f"llama.cpp: the native engine does not run it ({error.problem})")


def after_budget_refusal(model: str, refusal: MoedeskError, llama_cpp_problem=None) -> Choice:
    """auto, once the native engine found a GPU budget too small for a model's non-expert weights and KV cache: for a
    GGUF, llama.cpp, which keeps the file's packed weights packed on the GPU (the native engine holds them in 16
    bits) and can leave whole layers in RAM; otherwise the refusal again. The demo stays native: llama.cpp would run
    its dense source file, another model."""
    if model == "demo" or (llama_cpp_problem or _llama_cpp_problem)():
        raise refusal
    try:
        path = _gguf_for_llama_cpp(model)
    except MoedeskError:
        raise refusal from None
    return Choice("llama.cpp", path, f"llama.cpp: the native engine does not fit the GPU ({refusal})")


GGUF_ONLY = "the llama.cpp engine reads GGUF files only"


def not_gguf(requested: str, native_problem: str | None = None, read: bool = True) -> str | None:
    """Why loading a checkpoint that is no GGUF (safetensors) with the engine setting `requested` stops, in the line
    Engine.load stops with (after the model's name); None where the native engine loads it. native_problem: the
    native engine's refusal of it (UnsupportedModelError.problem); read=False: its config was not read, so whether
    the native engine runs it is not known. The download wizard says the same before downloading."""
    if requested == "llama.cpp":
        stop = f"{GGUF_ONLY}, so with the engine set to llama.cpp it would not load"
        if not read:
            return f"{stop}; set the engine to auto or native to run it natively, if the native engine implements " \
                   f"its architecture, or use a GGUF of this model"
        if native_problem:
            return f"{stop}, nor natively ({native_problem}): use a GGUF of this model"
        return f"{stop}; set the engine to auto or native to run it natively, or use a GGUF of this model"
    if native_problem is None:
        return None
    if requested == "native":
        return native_problem
    return f"{native_problem}, and {GGUF_ONLY}: use a GGUF of this model"


def listed_engine(arch: str, gguf: bool, requested: str = "auto", native_problem: str | None = None,
                  read: bool = True) -> Choice:
    """What would run a listed model (the Models screen, `moedesk list`), from its architecture alone: llama.cpp for a
    GGUF whose architecture the native engine does not read (or when asked for), else native (an unreadable header's
    "?" too: loading will say what is wrong). A checkpoint that is no GGUF and that the setting would not load
    (`not_gguf`, with its native refusal and whether its config was read) gets kind "none", `why` the line its load
    would stop with. `model` is left empty."""
    from moedesk.engine.load.gguf_checkpoint import NATIVE_ARCHITECTURES

    if not gguf and (stop := not_gguf(requested, native_problem, read)) is not None:
        return Choice("none", "", stop)
    if requested == "llama.cpp" and gguf:
        return Choice("llama.cpp", "", "llama.cpp engine, as set")
    if requested == "auto" and gguf and arch not in ("?", "") and arch not in NATIVE_ARCHITECTURES:
        return Choice("llama.cpp", "", f"llama.cpp: the native engine does not run {arch}")
    return Choice("native", "", "native engine" + (", as set" if requested == "native" else ""))


def llama_cpp_plan(model, requested: str = "auto", device: str = "auto", context: int | None = None,
                   gpu_budget: float | None = None):
    """What the llama.cpp engine's load would plan for `model` (a .gguf, any part of a split one, or a folder holding
    one) on this machine (engine.llamacpp.fit.Fit), where it would run it (auto's choice from its architecture, or
    `requested`); None where it would not. Reads the header alone."""
    from moedesk.engine.llamacpp.fit import gguf_shape, plan, read_header, this_machine, value
    from moedesk.engine.load.gguf_split import gguf_in_folder

    path = Path(model)
    if path.is_dir():
        path = gguf_in_folder(path, recursive=True) or path
    if path.suffix != ".gguf" or not path.is_file():
        return None
    header = read_header(path)
    if listed_engine(str(value(header, "general.architecture") or "?"), True, requested).kind != "llama.cpp":
        return None
    return plan(gguf_shape(header), this_machine(device), context, gpu_budget)


def llama_cpp_shape(header):
    """What the llama.cpp engine's placement reads of a GGUF header (engine.llamacpp.fit.GGUFShape)."""
    from moedesk.engine.llamacpp.fit import gguf_shape

    return gguf_shape(header)


def llama_cpp_fit(shape, device: str = "auto", context: int | None = None, gpu_budget: float | None = None,
                  available: int | None = None):
    """The llama.cpp engine's plan (engine.llamacpp.fit.Fit) for a GGUF of `shape` on this machine; `available`
    stands in for the memory this process may use. MoedeskError, one line, where a named budget cannot hold the rest."""
    from moedesk.engine.llamacpp.fit import plan, this_machine

    return plan(shape, this_machine(device, available), context, gpu_budget)


def preflight(model: str, engine: str = "auto") -> None:
    """Refuse quickly (MoedeskError, one line) what Engine.load would refuse, before a front end lets the model it
    has go: a missing file, an unreadable checkpoint, an architecture no engine runs. Reads headers only."""
    if model == "demo":
        return  # built on first use; nothing to check cheaply
    from moedesk.engine.load.checkpoint import open_checkpoint
    from moedesk.engine.model.architectures import parse_config

    if engine != "auto":
        choose_engine(model, engine)  # a GGUF for llama.cpp, a llama.cpp that loads
        if engine == "llama.cpp":
            return
    try:
        checkpoint = open_checkpoint(model)
    except UnsupportedModelError as refusal:
        after_refusal(refusal)  # a GGUF llama.cpp runs passes; anything else is refused, saying what would run it
        return
    parse_config(checkpoint.config, checkpoint.path)


def _llama_cpp_problem() -> str | None:
    from moedesk.engine.llamacpp.library import available

    return available()


def _gguf_for_llama_cpp(model: str) -> str:
    """The GGUF file llama.cpp loads for `model`: the demo's source file, the .gguf named, or the one in the folder
    or downloaded repo named; of a split GGUF, its first part (llama.cpp finds the others by their names), once
    every part is there."""
    from moedesk.engine.load.gguf_split import check_present, gguf_in_folder, part_paths

    if model == "demo":
        from moedesk.engine.load.demo import source_gguf

        return str(source_gguf())
    path = Path(model).expanduser()
    if path.is_dir():
        path = gguf_in_folder(path) or path
    elif not path.exists() and (cached := model_path(model)) is not None:  # a repo id in the HF cache
        path = gguf_in_folder(cached, recursive=True) or cached
    if path.suffix == ".gguf" and path.is_file():
        parts = part_paths(path)
        check_present(parts)
        return str(parts[0])
    if path.is_file() or path.is_dir():
        raise MoedeskError(f"{model}: {not_gguf('llama.cpp', *native_refusal(model))}")
    raise MoedeskError(f"{model}: no such GGUF file for the llama.cpp engine")


def native_refusal(model: str) -> tuple[str | None, bool]:
    """(the native engine's refusal of `model`, or None; whether its config could be read), from its headers as
    `preflight` reads them: what `not_gguf` needs to say what else would run it."""
    from moedesk.engine.load.checkpoint import open_checkpoint

    try:
        checkpoint = open_checkpoint(model)
    except Exception:  # noqa: BLE001 -- unreadable: the line leaves open whether the native engine runs it
        return None, False
    return config_refusal(checkpoint.config, checkpoint.path)


def config_refusal(config: dict, path) -> tuple[str | None, bool]:
    """`native_refusal` from a config.json already read (the model listings read it for their rows)."""
    from moedesk.engine.model.architectures import parse_config

    try:
        parse_config(config, path)
    except UnsupportedModelError as refusal:
        return refusal.problem, True
    except Exception:  # noqa: BLE001 -- unreadable: the line leaves open whether the native engine runs it
        return None, False
    return None, True
