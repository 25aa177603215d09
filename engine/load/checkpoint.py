"""Finding and opening a model: a Hugging Face folder, a .gguf file, a cached repo id, or the demo.

Every kind of checkpoint presents the same face: `config` (a config.json dict), `keys()` and
`get_tensor(name)` under Hugging Face tensor names, `tokenizer` and `tokenizer_config`.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import tokenizers
import torch
from safetensors import SafetensorError, safe_open

from moedesk.engine import json_read
from moedesk.engine.errors import CheckpointError, MoedeskError, UnsupportedModelError
from moedesk.engine.load.compressed_tensors import CompressedTensors, plan
from moedesk.engine.load.fp8_blocks import FP8Blocks, weight_blocks


class ModelFiles:
    """A Hugging Face model folder's small files: config.json (if any), the tokenizer and its template, the
    generation defaults. What a front end needs of a model some other machine runs (engine.remote)."""

    def __init__(self, folder):
        self.path = Path(folder)
        config_path = self.path / "config.json"
        self.config = _read_json(config_path) if config_path.is_file() else {}

    def shapes(self) -> None:
        return None

    @property
    def tokenizer(self) -> tokenizers.Tokenizer | None:
        path = self.path / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            return tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exception subclasses
            raise CheckpointError(path, f"unreadable tokenizer ({_first_line(e)})") from None

    @property
    def generation_defaults(self) -> dict:
        """The sampling generation_config.json recommends (engine.load.generation_defaults); {} without one."""
        from moedesk.engine.load.generation_defaults import from_generation_config

        path = self.path / "generation_config.json"
        return from_generation_config(_read_json(path)) if path.is_file() else {}

    @property
    def tokenizer_config(self) -> dict:
        path = self.path / "tokenizer_config.json"
        config = _read_json(path) if path.is_file() else {}
        template_file = self.path / "chat_template.jinja"  # where newer transformers save it
        if "chat_template" not in config and template_file.is_file():
            config["chat_template"] = template_file.read_text()
        return config


class SafetensorsCheckpoint(ModelFiles):
    """A Hugging Face model folder: config.json, one or many *.safetensors, optional tokenizer files."""

    # get_tensor only maps: the loader may copy several tensors out at once (engine.load.loader)
    concurrent_reads = True

    def __init__(self, folder):
        self.path = Path(folder)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(self.path, "no config.json in this folder")
        self.config = _read_json(config_path)
        # FP8 blocks and compressed-tensors weights are dequantised as read (engine.load.fp8_blocks and
        # engine.load.compressed_tensors, applied by open_checkpoint); gpt-oss's MXFP4 experts are kept as they are
        # (engine.load.fused_experts); any other quantisation is refused here (a multimodal checkpoint may say it of
        # its text model alone: Kimi-K2.5's INT4 experts).
        self.fp8_blocks = None if _is_gpt_oss_mxfp4(self.config) else weight_blocks(self.config, config_path)
        self.compressed = plan(self.config, config_path)
        self._where = self._index_tensors()
        self._open = {}
        self._opening = threading.Lock()
        self._unreleased: dict[Path, int] = {}  # tensors of each shard not yet released
        for file in self._where.values():
            self._unreleased[file] = self._unreleased.get(file, 0) + 1

    def _index_tensors(self) -> dict[str, Path]:
        index_path = self.path / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = _read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(index_path, "no weight_map in the index")
            for shard in sorted(set(weight_map.values())):
                if not (self.path / shard).is_file():
                    raise CheckpointError(self.path / shard, "shard listed in model.safetensors.index.json is missing")
            files = sorted({self.path / s for s in weight_map.values()})
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(self.path, "no *.safetensors files (moedesk never loads pickled .bin weights)")
        where = {}
        self._layout: dict[str, tuple[str, list[int], int, int]] = {}  # name -> (dtype, shape, first byte, end)
        for f in files:
            for name in self._handle(f).keys():  # safe_open checks the header's offsets against the file
                where[name] = f
            self._layout.update(_tensor_layout(f))
        self._fds: dict[Path, int] = {}
        return where

    def _handle(self, file: Path):
        if file.is_dir():  # safetensors would say "No such device (os error 19)"
            raise CheckpointError(file, "a folder, not a safetensors file")
        try:
            return safe_open(str(file), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(file, f"truncated or corrupt safetensors file ({_first_line(e)})") from None

    def keys(self) -> list[str]:
        return list(self._where)

    def shapes(self) -> None:
        """None: engine.model.architectures.parse_config reads the shapes from the safetensors headers itself."""
        return None

    def packed_format(self, name: str) -> str | None:
        """Safetensors hold float tensors only (see GGUFCheckpoint.packed_format)."""
        return None

    def close(self) -> None:
        """The files read from are closed; safetensors' handles are memory maps released with this object."""
        with self._opening:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def get_tensor(self, name: str, index: int | None = None, part: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name`, or only its slice `index` along the first dimension (one expert of a fused stack); `part`
        (i, n): only the i-th of that slice's n equal pieces along its own first dimension (gate's or up's rows of
        an expert whose two are fused), read alone."""
        file = self._where[name]
        dtype, shape, start, end = self._layout.get(name, (None, [], 0, 0))
        if dtype in _DTYPES and (index is None or 0 <= index < (shape or [0])[0]):
            return self._read(file, name, _DTYPES[dtype], shape, start, end, index, part)
        with self._opening:
            handle = self._open.get(file)
            if handle is None:
                handle = self._open[file] = self._handle(file)
        try:
            tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(file, f"cannot read tensor {name} ({_first_line(e)})") from None
        return tensor if part is None else tensor.chunk(part[1])[part[0]]

    def _read(self, file: Path, name: str, dtype: torch.dtype, shape: list[int], start: int, end: int,
              index: int | None, part: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor (or its slice `index`, or that slice's `part`) with plain reads at its offset. Not through
        safetensors' memory map: each page of a map that is read stays in the process's resident memory until the
        map closes, which for a one-file checkpoint meant holding the whole file until the end of the load."""
        if index is not None:
            row = (end - start) // shape[0]
            start, end, shape = start + index * row, start + (index + 1) * row, shape[1:]
        if part is not None:
            (i, n), piece = part, (end - start) // part[1]
            start, end, shape = start + i * piece, start + (i + 1) * piece, [shape[0] // n, *shape[1:]]
        out = torch.empty(end - start, dtype=torch.uint8)
        with self._opening:
            fd = self._fds.get(file)
            if fd is None:
                fd = self._fds[file] = os.open(file, os.O_RDONLY)
        view, done = memoryview(out.numpy()), 0
        while done < len(view):  # positioned reads: threads read at once; one read moves at most ~2 GiB
            got = os.preadv(fd, [view[done:]], start + done)
            if got <= 0:
                raise CheckpointError(file, f"truncated safetensors file: tensor {name} ends past the file's end")
            done += got
        return out.view(dtype).reshape(shape)

    def tensor_dtype(self, name: str) -> str:
        """A tensor's dtype as its file's header names it (F8_E4M3, BF16...), nothing read."""
        return self._layout[name][0]

    def get_tensor_shape(self, name: str) -> list[int]:
        """A tensor's shape from its file's header, nothing read."""
        file = self._where[name]
        with self._opening:
            handle = self._open.get(file) or self._open.setdefault(file, self._handle(file))
        return handle.get_slice(name).get_shape()

    def release(self, name: str) -> None:
        """The caller is done with tensor `name`. Once every tensor of a shard is, its memory map is dropped
        (unmapped when no tensor still views it): every page of a map that was read counts in the process's
        resident memory, so keeping them all until the end of a load doubled its peak."""
        file = self._where[name]
        with self._opening:
            self._unreleased[file] -= 1
            if self._unreleased[file] == 0:
                self._open.pop(file, None)
                if (fd := self._fds.pop(file, None)) is not None:
                    os.close(fd)


# safetensors dtype names -> torch's; a tensor of any other dtype is read through safetensors itself.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu}


def _tensor_layout(file: Path) -> dict[str, tuple[str, list[int], int, int]]:
    """name -> (dtype, shape, first byte, end byte) in `file`, from its header (which safe_open has checked)."""
    from moedesk.engine.load.size_estimate import read_safetensors_header

    header = read_safetensors_header(file)
    with open(file, "rb") as f:
        data = 8 + int.from_bytes(f.read(8), "little")
    return {name: (str(e["dtype"]), [int(d) for d in e["shape"]], data + int(e["data_offsets"][0]),
                   data + int(e["data_offsets"][1]))
            for name, e in header.items() if name != "__metadata__"}


def _is_gpt_oss_mxfp4(config: dict) -> bool:
    quantization = config.get("quantization_config")
    return (config.get("model_type") == "gpt_oss" and isinstance(quantization, dict)
            and quantization.get("quant_method") == "mxfp4")


def _with_experts_apart(checkpoint):
    """A block-FP8 or compressed-tensors release's weights dequantised as they are read (engine.load.fp8_blocks,
    engine.load.compressed_tensors). Qwen3-Next's,
    Qwen3.5-MoE's and Kimi-K2.5's checkpoints are shown as their text model, with the layout of projections the model
    reads; gpt-oss's and the released Qwen3.5-MoE's fuse each layer's experts into a few tensors, shown one expert at
    a time."""
    from moedesk.engine.load.fused_experts import FusedExperts, has_fused_experts

    if checkpoint.fp8_blocks is not None:
        checkpoint = FP8Blocks(checkpoint, checkpoint.fp8_blocks)
    elif checkpoint.compressed is not None:
        checkpoint = CompressedTensors(checkpoint, checkpoint.compressed)
    if checkpoint.config.get("model_type") in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "kimi_k25"):
        from moedesk.engine.load.delta_projections import as_the_model_reads_it
        checkpoint = as_the_model_reads_it(checkpoint)
    return FusedExperts(checkpoint) if has_fused_experts(checkpoint) else checkpoint


def _gguf(path: Path):
    """A GGUF file; Qwen3-Next's fused DeltaNet projections shown split (engine.load.delta_projections)."""
    from moedesk.engine.load.delta_projections import as_the_model_reads_it
    from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint

    return as_the_model_reads_it(GGUFCheckpoint(path))


def _read_json(path: Path) -> dict:
    try:
        value = json_read.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(path, f"unreadable JSON ({_first_line(e)})") from None
    if not isinstance(value, dict):
        raise CheckpointError(path, "expected a JSON object")
    return value


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _folder(folder: Path, recursive: bool):
    """A model folder, or a folder of one GGUF (one file, or the parts of one split file) without safetensors."""
    from moedesk.engine.load.gguf_split import gguf_in_folder

    if not list(folder.glob("*.safetensors")):
        if (gguf := gguf_in_folder(folder, recursive)) is not None:
            return _gguf(gguf)
    return _with_experts_apart(SafetensorsCheckpoint(folder))


def open_checkpoint(model: str):
    """Open what `--model` names: 'demo', a .gguf file (or any part of a split one), a model folder (or a folder of
    one GGUF), or a repo id in the HF cache."""
    if model == "demo":
        from moedesk.engine.load.demo import demo_checkpoint_dir
        return SafetensorsCheckpoint(demo_checkpoint_dir())
    path = Path(os.path.expanduser(model))
    if path.suffix == ".gguf" and not path.is_dir():  # a folder named *.gguf is read as the folder it is
        if not path.is_file():
            raise CheckpointError(path, "no such file")
        return _gguf(path)
    if path.is_dir():
        return _folder(path, recursive=False)
    if path.exists():
        raise CheckpointError(path, "not a model folder or .gguf file")
    cached = _cached_repo(model)
    if cached is not None:
        return _folder(cached, recursive=True)  # a downloaded GGUF quantisation may sit in a sub-folder
    raise MoedeskError(f"{model}: no such model folder, .gguf file, or repo in the local Hugging Face cache "
                       f"(download it first: moedesk download {model})")


def model_path(model: str) -> Path | None:
    """Where what `--model` names lies on disk ('demo', a folder, a .gguf file, a repo in the local HF cache), without
    opening it; None when it is none of those."""
    if model == "demo":
        from moedesk.engine.load.demo import demo_checkpoint_dir
        return demo_checkpoint_dir()
    from moedesk.engine.load.gguf_split import gguf_in_folder

    path = Path(os.path.expanduser(model))
    if path.is_dir() and (path / "config.json").is_file() or path.suffix == ".gguf" and path.is_file():
        return path
    if path.is_dir() and gguf_in_folder(path) is not None:
        return path
    if path.exists():
        return None
    return _cached_repo(model)


def _cached_repo(repo_id: str) -> Path | None:
    if repo_id.count("/") != 1:
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except getattr(errors, "IncompleteSnapshotError", ()) as e:
        # Part of a repo (one GGUF quantisation, say) is a complete model for us.
        return Path(e.snapshot_path)
    except (errors.LocalEntryNotFoundError, ValueError, OSError):
        return None
