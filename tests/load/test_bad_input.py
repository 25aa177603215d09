"""Bad model files through `moedesk batch`: one line on stderr naming the file and what is wrong, exit code 2,
and nothing the user had is modified (the model's files, an output file already there).

The cases here are those test_checkpoint_errors.py, test_hardening.py and test_gguf_checkpoint.py do not already
take through the CLI or the loader: a broken safetensors header, offsets past the file's end, weights that are not
floats, a config.json or tokenizer.json that is not JSON, a config asking for the repo's own code (auto_map), an
empty folder, a file of another kind, a split GGUF (with and without all its parts), an unknown GGUF tensor type.
"""
import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moedesk.app.cli import main
from moedesk.engine.errors import CheckpointError
from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint
from tests.load.test_gguf_checkpoint import write_tiny_mixtral

WEIGHTS = "model.safetensors"


def fingerprint(folder: Path) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def batch_error(model, tmp_path, capsys) -> str:
    """Run `moedesk batch` on `model`: it must fail with exit code 2 and one line, leaving every file as it was."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "Hello"}\n')
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "earlier", "text": "a result from an earlier run"}\n')
    folder = Path(model) if Path(model).is_dir() else Path(model).parent
    before, before_out = fingerprint(folder), out.read_bytes()
    capsys.readouterr()
    code = main(["batch", str(src), "-o", str(out), "--model", str(model), "--device", "cpu", "--max-new-tokens", "1"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1, captured.err
    assert fingerprint(folder) == before and out.read_bytes() == before_out
    return lines[0]


def rewrite_header(file: Path, edit) -> None:
    data = file.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = edit(json.loads(data[8:8 + n]))
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def past_the_end(header: dict) -> dict:
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    start, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [start, end + 4096]
    return header


def retype(folder: Path, name: str, dtype) -> None:
    tensors = load_file(folder / WEIGHTS)
    tensors[name] = (tensors[name] * 100).to(dtype)
    save_file(tensors, folder / WEIGHTS)


def with_auto_map(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="evil_moe", architectures=["EvilForCausalLM"],
                  auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    for module in ("configuration_evil", "modeling_evil"):
        (folder / f"{module}.py").write_text("import pathlib\npathlib.Path(__file__).with_suffix('.ran').touch()\n")


class Evil:
    """Unpickled, it touches `mark`: code run by loading a pickle."""

    def __init__(self, mark: Path):
        self.mark = mark

    def __reduce__(self):
        return (Path.touch, (self.mark,))


def pickled_only(folder: Path) -> None:
    """pytorch_model.bin beside no safetensors, holding an object whose unpickling would run code."""
    tensors = load_file(folder / WEIGHTS)
    (folder / WEIGHTS).unlink()
    torch.save({**tensors, "evil": Evil(folder / "unpickled.ran")}, folder / "pytorch_model.bin")


def broken_index(folder: Path, text: str) -> None:
    (folder / "model.safetensors.index.json").write_text(text)


def reshaped(folder: Path, name: str) -> None:
    tensors = load_file(folder / WEIGHTS)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, folder / WEIGHTS)


def quantised(folder: Path, method: str, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "weight_block_size": [128, 128], **fields}
    (folder / "config.json").write_text(json.dumps(config))


def fp8_weight(folder: Path, name: str, scale_shape: tuple | None) -> None:
    """`name` as float8_e4m3fn, with a scale of `scale_shape` beside it (None: none), under an fp8 config."""
    quantised(folder, "fp8", fmt="e4m3", activation_scheme="dynamic")
    tensors = load_file(folder / WEIGHTS)
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    if scale_shape is not None:
        tensors[name + "_scale_inv"] = torch.ones(scale_shape)
    save_file(tensors, folder / WEIGHTS)


def emptied(folder: Path) -> None:
    for p in folder.iterdir():
        p.unlink()


CASES = {
    # case: (how the folder is spoiled, the file the line names (relative to the folder), what it says)
    "broken header JSON": (lambda f: rewrite_header(f / WEIGHTS, lambda h: json.dumps(h).encode()[:-3] + b"xyz"),
                           WEIGHTS, "truncated or corrupt safetensors file"),
    "offsets past the end": (lambda f: rewrite_header(f / WEIGHTS, past_the_end),
                             WEIGHTS, "truncated or corrupt safetensors file"),
    "integer weights": (lambda f: retype(f, "model.layers.0.self_attn.q_proj.weight", torch.int32),
                        "", "tensor model.layers.0.self_attn.q_proj.weight holds int32 values, not floating-point"),
    "integer experts": (lambda f: retype(f, "model.layers.1.block_sparse_moe.experts.2.w2.weight", torch.int64),
                        "", "tensor model.layers.1.block_sparse_moe.experts.2.w2.weight holds int64 values"),
    "boolean norm": (lambda f: retype(f, "model.norm.weight", torch.bool), "", "model.norm.weight holds bool values"),
    "config not JSON": (lambda f: (f / "config.json").write_text('{"model_type": "mixtral",'),
                        "config.json", "unreadable JSON"),
    "config not an object": (lambda f: (f / "config.json").write_text("[]"), "config.json", "expected a JSON object"),
    "tokenizer not JSON": (lambda f: (f / "tokenizer.json").write_text('{"model": '),
                           "tokenizer.json", "unreadable tokenizer"),
    "auto_map": (with_auto_map, "", "unsupported architecture 'evil_moe'"),
    "empty folder": (emptied, "", "no config.json in this folder"),
    # GPTQ/AWQ tensors would be refused as an "unexpected tensor ...qweight": the config says what they are. Block
    # FP8 loads (tests/load/test_fp8_blocks.py), but not a variant whose numbers or math differ, nor fp8 numbers
    # without their scales (the weights divided by them: 100s of times too small).
    "gptq quantised": (lambda f: quantised(f, "gptq"), "config.json",
                       "weights quantised with 'gptq' (its quantization_config), which moedesk does not load"),
    "fp8 e5m2": (lambda f: quantised(f, "fp8", fmt="e5m2"), "config.json",
                 "fp8 weights with fmt 'e5m2' (its quantization_config), which moedesk does not load"),
    "fp8 static activations": (lambda f: quantised(f, "fp8", activation_scheme="static"), "config.json",
                               "fp8 weights with activation_scheme 'static' (its quantization_config)"),
    "fp8 fp4 experts": (lambda f: quantised(f, "fp8", expert_dtype="fp4"), "config.json",
                        "fp8 weights with expert_dtype 'fp4'"),
    "fp8 per tensor": (lambda f: quantised(f, "fp8", weight_block_size=None), "config.json",
                       "fp8 weights with weight_block_size None (two positive whole numbers expected)"),
    "fp8 weight without its scale": (
        lambda f: fp8_weight(f, "model.layers.0.self_attn.q_proj.weight", None), "",
        "tensor model.layers.0.self_attn.q_proj.weight holds F8_E4M3 values without its "
        "model.layers.0.self_attn.q_proj.weight_scale_inv"),
    "fp8 scale of the wrong shape": (
        lambda f: fp8_weight(f, "model.layers.1.block_sparse_moe.experts.2.w2.weight", (2, 1)), "",
        "tensor model.layers.1.block_sparse_moe.experts.2.w2.weight_scale_inv has shape (2, 1): "
        "model.layers.1.block_sparse_moe.experts.2.w2.weight of shape (64, 48) in 128x128 blocks implies (1, 1)"),
    "fp8 weights without an fp8 config": (
        lambda f: retype(f, "model.layers.0.self_attn.o_proj.weight", torch.float8_e4m3fn), "",
        "tensor model.layers.0.self_attn.o_proj.weight holds float8_e4m3fn values without their scales"),
    "pickled .bin only": (pickled_only, "", "no *.safetensors files (moedesk never loads pickled .bin weights)"),
    "index not JSON": (lambda f: broken_index(f, '{"weight_map": '), "model.safetensors.index.json", "unreadable JSON"),
    "index without weight_map": (lambda f: broken_index(f, '{"metadata": {}}'), "model.safetensors.index.json",
                                 "no weight_map in the index"),
    "tokenizer_config not JSON": (lambda f: (f / "tokenizer_config.json").write_text("{"), "tokenizer_config.json",
                                  "unreadable JSON"),
    "expert of the wrong shape": (lambda f: reshaped(f, "model.layers.0.block_sparse_moe.experts.0.w1.weight"), "",
                                  "tensor model.layers.0.block_sparse_moe.experts.0.w1.weight has shape (48, 63), "
                                  "the config implies (48, 64)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_model_folder_is_one_line_and_changes_nothing(case, mixtral, tmp_path, capsys):
    spoil, names, says = CASES[case]
    spoil(mixtral)
    line = batch_error(mixtral, tmp_path, capsys)
    named = mixtral / names if names else mixtral
    assert line.startswith(f"moedesk: {named}: ") and says in line, line
    assert not list(mixtral.glob("*.ran"))  # the repo's own code never ran


@pytest.mark.parametrize("name", ["notes.txt", WEIGHTS, "config.json"])
def test_a_file_of_another_kind_is_one_line(name, mixtral, tmp_path, capsys):
    (mixtral / "notes.txt").write_text("not a model")
    line = batch_error(mixtral / name, tmp_path, capsys)
    assert line == f"moedesk: {mixtral / name}: not a model folder or .gguf file"


def test_an_unknown_gguf_tensor_type_is_named(tmp_path):
    path = tmp_path / "odd.gguf"
    write_tiny_mixtral(path)
    data = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    at = data.index(name) + len(name)
    dims = int.from_bytes(data[at:at + 4], "little")
    at += 4 + 8 * dims
    data[at:at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        GGUFCheckpoint(path)
    assert str(e.value) == f"{path}: corrupt GGUF header (tensor token_embd.weight has unknown type 99)"


def test_a_folder_where_a_file_should_be_is_one_line(mixtral, tmp_path, capsys):
    """A shard that is a folder (a botched copy) is named as such; a folder named *.gguf is read as a folder."""
    (mixtral / WEIGHTS).rename(tmp_path / "moved.safetensors")
    (mixtral / WEIGHTS).mkdir()
    line = batch_error(mixtral, tmp_path, capsys)
    assert line == f"moedesk: {mixtral / WEIGHTS}: a folder, not a safetensors file"
    (mixtral / WEIGHTS).rmdir()
    (tmp_path / "moved.safetensors").rename(mixtral / WEIGHTS)
    shutil.copytree(mixtral, tmp_path / "model.gguf")
    (tmp_path / "model.gguf" / "config.json").write_text("{")
    line = batch_error(tmp_path / "model.gguf", tmp_path, capsys)
    assert line.startswith(f"moedesk: {tmp_path / 'model.gguf' / 'config.json'}: unreadable JSON"), line
