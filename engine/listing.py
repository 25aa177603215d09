"""What front ends show of a model on disk before loading it: the architectures the native engine implements, a GGUF
file as the native engine reads its header (a split GGUF listed once, from its parts), and where the built-in demo
is built and its shape.

Headers and the demo's recipe only: nothing here reads a weight or builds the demo. Imports stay inside the
functions, so that a front end listing models does not pay for torch before it needs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def native_model_types() -> frozenset[str]:
    """The config.json `model_type`s the native engine implements, those that name one of them (Kimi-K2's), and the
    multimodal ones whose text model it runs (Kimi-K2.5's)."""
    from moedesk.engine.model.architectures import ARCHITECTURES, SAME_AS, TEXT_MODELS

    return frozenset(ARCHITECTURES) | frozenset(SAME_AS) | frozenset(TEXT_MODELS)


@dataclass(frozen=True)
class GGUFListing:
    arch: str  # the model_type the native engine reads the file as
    config: dict  # the config.json the native engine derives from the file's metadata
    weights: object = None  # size_estimate.ModelWeights: what loading takes; None where it could not be said
    estimate_error: Exception | None = None  # why there is no `weights`
    llama_shape: object = None  # engine.llamacpp.fit.GGUFShape: what llama.cpp's placement needs of it


def read_gguf(path) -> GGUFListing:
    """A GGUF file as the native engine reads its header (parsing a large vocabulary takes seconds: a listing reads
    it once). Raises what the engine raises for a file it refuses (UnsupportedModelError, CheckpointError, ...)."""
    from moedesk.engine.llamacpp.fit import gguf_shape
    from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint
    from moedesk.engine.load.size_estimate import gguf_tensors, summarize

    checkpoint = GGUFCheckpoint(path)
    try:
        try:
            weights, error = summarize(checkpoint.config, gguf_tensors(checkpoint), path), None
        except Exception as e:  # noqa: BLE001 -- the listing shows why, and loading says it again
            weights, error = None, e
        return GGUFListing(checkpoint.arch, checkpoint.config, weights, error, gguf_shape(checkpoint.header))
    finally:
        checkpoint.close()


def gguf_parts(path: Path) -> list[Path]:
    """The files a GGUF is in: itself, or every part of the split GGUF it is a part of (by name; there or not)."""
    from moedesk.engine.load.gguf_split import part_paths

    return part_paths(Path(path))


def gguf_models(files: list[Path]) -> list[Path]:
    """Of these .gguf files, those a listing shows as models: each single file, and of a split GGUF its first
    part alone (or, where that is missing, the first part found, which loading names the missing part of)."""
    from moedesk.engine.load.gguf_split import split_stem

    firsts: dict[Path, Path] = {}
    for f in sorted(files):
        firsts.setdefault(split_stem(f), f)
    return sorted(firsts.values(), key=lambda p: str(p).lower())


def gguf_header(path):
    """A GGUF's metadata and tensor infos as gguf's reader reads them (`fields`, `tensors`), every part of a split one
    joined: for a file the native engine refuses, what llama.cpp would run."""
    from gguf import GGUFReader

    from moedesk.engine.load.gguf_split import open_gguf

    return open_gguf(Path(path), GGUFReader)


def demo_folder() -> Path:
    """Where the demo model is built in moedesk's cache folder (there or not yet)."""
    from moedesk.engine.load.demo import demo_folder as folder

    return folder()


def demo_built() -> bool:
    """Whether the demo is built: opening it before then builds it first, which reports no progress."""
    return (demo_folder() / "config.json").is_file()


def demo_shape() -> tuple[int, int]:
    """The demo's (routed experts, experts per token), from its recipe."""
    from moedesk.engine.load.demo import recipe

    r = recipe()
    return int(r.get("num_experts", 0)), int(r.get("num_experts_per_tok", 0))
