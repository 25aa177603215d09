"""Models on this computer that moedesk can open: the demo, the user's models folder, the HF cache.

Nothing is loaded here; only small files (config.json, safetensors and GGUF headers) are read, so
listing is quick even for huge models, and each model's memory once loaded is estimated from them
(engine.load.size_estimate). No Textual here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from moedesk.app.tui.storage import models_dir, read_json
from moedesk.engine.errors import MoedeskError

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "num_experts_per_token")


@dataclass(frozen=True)
class LocalModel:
    spec: str  # what Engine.load / --model takes
    name: str  # what a person reads
    source: str  # "demo" | "folder" | "gguf" | "hf cache"
    size_bytes: int | None  # on disk; None when not there yet (the demo before its first use)
    arch: str = "?"  # config.json model_type or GGUF general.architecture
    num_experts: int = 0
    top_k: int = 0
    supported: bool | None = None  # None: unknown
    note: str = ""
    # Its tensors sorted for the memory estimate (engine.load.size_estimate.ModelWeights), kept so that a changed
    # expert dtype re-estimates without reading headers again; None with `estimate_error` saying why.
    weights: object = field(default=None, compare=False, repr=False)
    estimate_error: str = ""
    # A GGUF's header as llama.cpp's placement reads it (engine.llamacpp.fit.GGUFShape): what its fit line is planned
    # from where llama.cpp would run it; None for other models.
    llama_shape: object = field(default=None, compare=False, repr=False)
    # A checkpoint's config.json as the native engine's load judges it (engine.selection.config_refusal): its refusal,
    # or None; whether the config could be read. What row_engine needs for a setting that would not load it.
    refusal: str | None = None
    config_read: bool = True

    def estimate(self, expert_dtype: str, weights_dtype: str, gpu: bool = False):
        """The MemoryEstimate of loading it with these dtypes; None when its headers could not be sorted."""
        return None if self.weights is None else self.weights.estimate(expert_dtype, weights_dtype, gpu)

    @property
    def experts(self) -> str:
        if self.arch == "?":
            return "?"
        if not self.num_experts:
            return "dense"
        return f"{self.num_experts} × top-{self.top_k}" if self.top_k else f"{self.num_experts}"


def human_size(n: int | None) -> str:
    if n is None:
        return "—"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def estimate_line(estimate, gpu: bool, size: Callable[[int], str]) -> str:
    """A MemoryEstimate in a few words: "~26.4 GB in RAM as q4_0 experts + 3.2 GB on the GPU". `gpu`: a CUDA GPU
    will load it (the experts stay in RAM, the rest goes to the GPU); `size` writes a byte count."""
    if not estimate.expert_bytes:
        return f"~{size(estimate.other_bytes)} on the GPU" if gpu else f"~{size(estimate.other_bytes)} in RAM"
    experts = f"{estimate.experts_as} experts"
    if gpu:
        table = " and the token table" if estimate.table_bytes else ""
        return (f"~{size(estimate.ram_bytes(True))} in RAM as {experts}{table} + {size(estimate.gpu_bytes(True))} on "
                f"the GPU")
    return f"~{size(estimate.total_bytes)} in RAM, {size(estimate.expert_bytes)} of it {experts}"


def llama_fit(shape, target, available: int | None = None):
    """What the llama.cpp engine's load would plan for a GGUF of `shape` (engine.llamacpp.fit.GGUFShape) with the
    device, context and GPU budget of `target` (app.tui.load_target.LoadTarget): its Fit, or the one line saying why
    the load would stop before placing anything."""
    from moedesk.engine.errors import MoedeskError
    from moedesk.engine.selection import llama_cpp_fit

    if target.budgets:
        return f"does not load: llama.cpp takes one --gpu-budget figure, not {len(target.budgets)}"
    try:
        return llama_cpp_fit(shape, target.device, target.context, target.gpu_budget, available)
    except MoedeskError as e:  # a named budget that cannot hold the rest: the load's own line
        return f"does not fit: {e}"


def row_engine(model: LocalModel, requested: str):
    """What would load a listed model with the engine setting `requested`: engine.selection.listed_engine's Choice,
    of kind "none" (its `why` the line the load would stop with) for a checkpoint that setting would not load. The
    Models screen and `moedesk list` both decide here. The demo is a GGUF to llama.cpp (its source file)."""
    from moedesk.engine.selection import listed_engine

    gguf = (model.source in ("gguf", "hf cache") and model.spec.endswith(".gguf")) or \
        (model.spec == "demo" and requested == "llama.cpp")
    return listed_engine(model.arch, gguf, requested, model.refusal, model.config_read)


def gguf_engine_plan(arch: str, shape, target, available: int | None = None):
    """(what loads a GGUF of `arch` with the target's engine setting: engine.selection.listed_engine's Choice; for
    llama.cpp, the plan its load makes from the header's `shape`, else None). The Models screen and the download
    wizard both decide here, so that they show the same engine and figures for the same file."""
    from moedesk.engine.selection import listed_engine

    choice = listed_engine(arch, True, target.engine)
    if choice.kind != "llama.cpp" or shape is None:
        return choice, None
    return choice, llama_fit(shape, target, available)


def _weights(path: Path) -> tuple[object, str]:
    """(ModelWeights, "") for a model folder or .gguf file, or (None, why not) in a few words."""
    try:
        from moedesk.engine.load.size_estimate import summarize_path

        return summarize_path(path), ""
    except Exception as e:  # noqa: BLE001 -- an estimate is advice: loading says what is wrong, in full
        return None, _one_line(e)


def _one_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def folder_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size  # follows HF cache symlinks to blobs
            except OSError:
                pass
    return total


def supported_architectures() -> set[str]:
    try:
        from moedesk.engine.listing import native_model_types
        return set(native_model_types())
    except Exception:  # the engine is being edited elsewhere; a listing must not fail for it
        return set()


def describe_config(config: dict) -> tuple[str, int, int]:
    """(model_type, routed experts, experts per token) from a config.json dict."""
    arch = str(config.get("model_type") or "?")
    experts = next((config[k] for k in EXPERT_COUNT_KEYS if isinstance(config.get(k), int)), 0)
    top_k = next((config[k] for k in TOP_K_KEYS if isinstance(config.get(k), int)), 0)
    return arch, experts, top_k


def folder_model(path: Path, source: str, spec: str | None = None, name: str | None = None,
                 size: int | None = None, known: set[str] | None = None) -> LocalModel:
    from moedesk.engine.selection import config_refusal

    refusal, read = None, False
    try:
        config = read_json(path / "config.json")
        arch, experts, top_k = describe_config(config if isinstance(config, dict) else {})
        note = "" if any(path.glob("*.safetensors")) else "no .safetensors files"
        if isinstance(config, dict):
            refusal, read = config_refusal(config, path / "config.json")
    except (OSError, ValueError):
        arch, experts, top_k, note = "?", 0, 0, "unreadable config.json"
    known = supported_architectures() if known is None else known
    supported = (arch in known) if known and arch != "?" else None
    weights, why = _weights(path) if supported is not False and not note else (None, "")
    return LocalModel(spec or str(path), name or path.name, source, folder_size(path) if size is None else size,
                      arch, experts, top_k, supported, note, weights, why, refusal=refusal, config_read=read)


def gguf_model(path: Path) -> LocalModel:
    """A .gguf file, or the first part of a split one: listed once, its size that of every part."""
    from moedesk.engine.listing import gguf_parts

    arch, experts, top_k, note = "?", 0, 0, ""
    weights, why, shape = None, "", None
    try:
        # The engine's own reading of the header; a file it refuses is read again below for what the listing shows.
        from moedesk.engine.listing import read_gguf

        listing = read_gguf(path)
        arch, experts, top_k = listing.arch, *describe_config(listing.config)[1:]
        weights, shape = listing.weights, listing.llama_shape
        why = _one_line(listing.estimate_error) if listing.estimate_error is not None else ""
    except Exception as e:  # noqa: BLE001
        why = _one_line(e)
        try:
            from moedesk.engine.listing import gguf_header
            from moedesk.engine.load.size_estimate import file_weights
            from moedesk.engine.selection import listed_engine, llama_cpp_shape

            reader = gguf_header(path)
            arch = _gguf_value(reader, "general.architecture") or "?"
            experts = int(_gguf_value(reader, f"{arch}.expert_count") or 0)
            top_k = int(_gguf_value(reader, f"{arch}.expert_used_count") or 0)
            if listed_engine(arch, gguf=True).kind == "llama.cpp":  # it runs from the file as it is
                weights, why, shape = file_weights(arch, reader.tensors), "", llama_cpp_shape(reader)
        except MoedeskError as e:  # a split GGUF missing a part: the line that names it
            why = _one_line(e)
        except Exception as e:  # a truncated or foreign file: list it anyway, loading will say what is wrong
            note, why = f"unreadable header ({type(e).__name__})", ""
    # GGUF architecture names differ from config.json's (Mixtral is "llama" with experts): support is
    # left unknown here, and loading says what is wrong.
    parts = gguf_parts(path)
    size = sum(p.stat().st_size for p in parts) if all(p.exists() for p in parts) else None
    return LocalModel(str(path), path.name, "gguf", size, arch, experts, top_k, None, note, weights, why, shape)


def _gguf_value(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    if hasattr(field, "contents"):
        return field.contents()
    part = field.parts[field.data[0]]
    try:
        return bytes(part).decode("utf-8")
    except (TypeError, UnicodeDecodeError):
        return part[0] if len(part) else None


def demo_folder() -> Path:
    """Where the demo is built, in moedesk's cache (there or not)."""
    from moedesk.engine.listing import demo_folder as folder

    return folder()


def demo_model() -> LocalModel:
    try:
        from moedesk.engine.listing import demo_built, demo_shape

        folder, built = demo_folder(), demo_built()
        weights, why = _weights(folder) if built else (None, "")
        return LocalModel("demo", "demo (SmolLM2-135M as an MoE)", "demo", folder_size(folder) if built else None,
                          "mixtral", *demo_shape(), True, "" if built else "built on first use", weights, why)
    except Exception:
        return LocalModel("demo", "demo", "demo", None, "mixtral", 0, 0, True, "")


def scan_models_dir(folder: Path, known: set[str] | None = None) -> list[LocalModel]:
    """Model folders (with config.json) and .gguf files in `folder`, up to two levels down (org/name)."""
    from moedesk.engine.listing import gguf_models

    found = []
    if not folder.is_dir():
        return found
    known = supported_architectures() if known is None else known

    def visit(directory: Path, depth: int):
        try:
            entries = sorted(directory.iterdir(), key=lambda p: p.name.lower())
        except OSError:
            return
        # a split GGUF's parts are one model: its first part stands for it
        ggufs = gguf_models([e for e in entries if e.is_file() and e.suffix == ".gguf" and not e.name.startswith(".")])
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry in ggufs:
                found.append(gguf_model(entry))
            elif entry.is_dir():
                if (entry / "config.json").is_file():
                    found.append(folder_model(entry, "folder", name=str(entry.relative_to(folder)), known=known))
                elif depth < 2:
                    visit(entry, depth + 1)

    visit(folder, 1)
    return found


def scan_hf_cache(cache_dir: Path | str | None = None, known: set[str] | None = None) -> list[LocalModel]:
    """Model repos in the local Hugging Face cache that hold a config.json (their newest snapshot)."""
    try:
        from huggingface_hub import constants, scan_cache_dir

        # scan_cache_dir's own default is HF_HUB_CACHE as it was when its module was first imported.
        info = scan_cache_dir(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE)
    except Exception:  # no cache yet (CacheNotFound) or an unreadable one
        return []
    from moedesk.engine.listing import gguf_models

    known = supported_architectures() if known is None else known
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        main = [r for r in repo.revisions if "main" in r.refs]
        revision = main[0] if main else max(repo.revisions, key=lambda r: r.last_modified)
        snapshot = Path(revision.snapshot_path)
        if (snapshot / "config.json").is_file():
            out.append(folder_model(snapshot, "hf cache", spec=repo.repo_id, name=repo.repo_id,
                                    size=repo.size_on_disk, known=known))
        else:
            # A quantisation may sit in a sub-folder (Q4_K_M/name-00001-of-00003.gguf), as large split ones do.
            for gguf in gguf_models([p for p in snapshot.rglob("*.gguf") if not p.name.lower().startswith("mmproj")]):
                m = gguf_model(gguf)
                name = f"{repo.repo_id}/{gguf.relative_to(snapshot).as_posix()}"
                out.append(LocalModel(m.spec, name, "hf cache", m.size_bytes, m.arch, m.num_experts, m.top_k,
                                      m.supported, m.note, m.weights, m.estimate_error, m.llama_shape))
    return out


def find_models(folder: Path | None = None, hf_cache: bool = True) -> list[LocalModel]:
    """Everything the models screen lists: the demo first, then the models folder, then the HF cache."""
    known = supported_architectures()
    models = [demo_model()]
    models += scan_models_dir(models_dir() if folder is None else Path(folder), known)
    if hf_cache:
        models += scan_hf_cache(known=known)
    return models
