"""Checkpoints released in block-scaled FP8 (DeepSeek-V3.x, Kimi-K2, MiniMax-M2, the Qwen3 "-FP8" releases), shown as
float ones.

Their config says `quantization_config: {quant_method: "fp8", fmt: "e4m3", weight_block_size: [B0, B1],
activation_scheme: "dynamic"}`. Each quantised matrix `X.weight` [rows, cols] is float8_e4m3fn and `X.weight_scale_inv`
[ceil(rows / B0), ceil(cols / B1)] holds the factor every B0 x B1 block is multiplied by to give the weights (the last
row and column of blocks may be partial). Norms, routers, embeddings and lm_head are left unquantised: a weight is
dequantised where it has a scale beside it, whatever the config lists. `FP8Blocks` dequantises each weight alone as it
is read (float32, exact: the fp8 value times its block's scale), so a load holds one tensor's float copy at a time.
"""
from __future__ import annotations

import math

import torch

from moedesk.engine.errors import CheckpointError, UnsupportedModelError
from moedesk.engine.model.architectures import text_config

SCALE = "_scale_inv"  # X.weight's scale is X.weight_scale_inv
_FMTS = (None, "e4m3", "float8_e4m3fn")  # how the releases spell e4m3 (MiniMax-M2: float8_e4m3fn)
# "dynamic": activations are rounded to fp8 at run time by the kernels that compute in fp8, a rounding of the kernel
# and not of the model (transformers' dequantising load drops it too). "static" scales them by checkpoint factors.
_ACTIVATIONS = (None, "dynamic")
_SCALE_FMTS = (None, "float", "ue8m0")  # ue8m0 (DeepSeek-V3.1): powers of two, stored as floats or as exponents


def weight_blocks(config: dict, path) -> tuple[int, int] | None:
    """(B0, B1), the scale blocks of a block-FP8 checkpoint's config; None when it has no quantization_config, or a
    compressed-tensors one (engine.load.compressed_tensors reads those). One-line
    UnsupportedModelError naming what this module does not load: another quant_method, or an fp8 variant whose
    numbers or math differ (fmt e5m2, static activation scales, FP4 experts, no block size)."""
    quantization = quantization_config(config)
    if quantization is None:
        return None
    method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
    if method == "compressed-tensors":
        return None
    if method != "fp8":  # GPTQ, AWQ, bitsandbytes...: tensors meaningless without their own rule
        raise UnsupportedModelError(path, f"weights quantised with {method!r} (its quantization_config), which moedesk "
                                          f"does not load: use the model's unquantised or FP8 safetensors, or a GGUF")

    def refuse(what: str) -> UnsupportedModelError:
        return UnsupportedModelError(path, f"fp8 weights with {what} (its quantization_config), which moedesk does not "
                                           f"load: use the model's unquantised safetensors or a GGUF of it")

    for key, known in (("fmt", _FMTS), ("activation_scheme", _ACTIVATIONS), ("scale_fmt", _SCALE_FMTS),
                       ("expert_dtype", (None, "fp8"))):
        if quantization.get(key) not in known:
            raise refuse(f"{key} {quantization.get(key)!r}")
    block = quantization.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise refuse(f"weight_block_size {block!r} (two positive whole numbers expected)")
    return int(block[0]), int(block[1])


def without_scales(config: dict, tensors: dict, path) -> dict:
    """A checkpoint's {name: ...} as FP8Blocks shows it, for sizing it from its headers: a block-FP8 release's scales
    left out (its config checked as weight_blocks does); any other checkpoint's as it is."""
    quantization = quantization_config(config)
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        return tensors
    weight_blocks(config, path)
    return {name: t for name, t in tensors.items() if not name.endswith(SCALE)}


def quantization_config(config: dict):
    """The quantization_config, or a multimodal checkpoint's text model's (Kimi-K2.5's)."""
    return config.get("quantization_config") or text_config(config).get("quantization_config")


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weights [..., rows, cols] in `dtype` from fp8 `weight` and `scale` [..., ceil(rows / B0), ceil(cols / B1)]: each
    value times its block's scale in float32, rounded once to `dtype`. A scale held as a uint8 exponent (ue8m0) is
    2 ** (byte - 127)."""
    factors = (scale.to(torch.float32) - 127).exp2() if scale.dtype == torch.uint8 else scale.to(torch.float32)
    b0, b1 = block
    rows, cols = weight.shape[-2:]
    along = factors.repeat_interleave(b1, dim=-1)[..., :cols]  # 1/B0 of the weight's size
    # fp8 values are exact in any of the dtypes; each block-row is then multiplied in place (torch computes a 16-bit
    # tensor times a float32 one in float32 and rounds once). No float32 copy of the weight is made and freed beside
    # the result: freed, it would raise glibc's threshold for mapping allocations, and the load's later tensors would
    # fragment the heap.
    out = weight.to(dtype)
    for i in range(math.ceil(rows / b0)):
        out[..., i * b0:(i + 1) * b0, :].mul_(along[..., i:i + 1, :])
    return out


def scale_shape(shape, block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of `shape`."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


class FP8Blocks:
    """A SafetensorsCheckpoint of a block-FP8 release with its weights dequantised as read and its scales hidden (see
    the module's docstring)."""

    def __init__(self, inner, block: tuple[int, int]):
        self.inner, self.block = inner, block
        self.dtype, self.device = torch.float32, torch.device("cpu")  # where weights are dequantised (dequantise_in)
        names = set(inner.keys())
        self._scales = {}  # weight name -> its scale's name
        for name in names:
            if name.endswith(SCALE):
                weight = name.removesuffix(SCALE)
                if weight not in names:
                    raise CheckpointError(inner.path, f"{name} scales no tensor: there is no {weight}")
                self._scales[weight] = name
        for name in names - set(self._scales.values()):
            dtype, shape = inner.tensor_dtype(name), inner.get_tensor_shape(name)
            if name in self._scales:
                if dtype != "F8_E4M3":
                    raise CheckpointError(inner.path, f"tensor {name} holds {dtype}, not the float8_e4m3fn values "
                                                      f"its {self._scales[name]} scales")
                found, wanted = tuple(inner.get_tensor_shape(self._scales[name])), scale_shape(shape, block)
                if found != wanted:
                    raise CheckpointError(inner.path, f"tensor {self._scales[name]} has shape {found}: {name} of "
                                                      f"shape {tuple(shape)} in {block[0]}x{block[1]} blocks "
                                                      f"implies {wanted}")
            elif dtype.startswith("F8_"):  # fp8 numbers without their scale would be the weights divided by it
                raise CheckpointError(inner.path, f"tensor {name} holds {dtype} values without its {name}{SCALE}")

    def __getattr__(self, name):  # path, config, tokenizer, tokenizer_config, close, concurrent_reads...
        return getattr(self.inner, name)

    def keys(self) -> list[str]:
        hidden = set(self._scales.values())
        return [n for n in self.inner.keys() if n not in hidden]

    def dequantise_in(self, dtype: torch.dtype, device="cpu") -> None:
        """Weights read from now on come in `dtype` (the loader's: the model's), each value rounded once, computed on
        `device`: a GPU takes the fp8 bytes (a quarter of float32's over PCIe) and dequantises them far faster than
        the CPU, and a load onto a GPU sends each weight there anyway (experts in RAM: quantised there, then back)."""
        self.dtype, self.device = dtype, torch.device(device)

    def stored_fp8(self, name: str) -> bool:
        """Whether tensor `name` is fp8 in the file."""
        return name in self._scales

    def released_as(self, name: str) -> str | None:
        """What `--expert-dtype auto` quantises weight `name` to (engine.load.loader.expert_formats): an fp8 one to
        int8, a byte a weight as released."""
        return "int8" if name in self._scales else None

    def get_tensor(self, name: str, index: int | None = None, part: tuple[int, int] | None = None) -> torch.Tensor:
        """As SafetensorsCheckpoint.get_tensor; a quantised weight dequantised, in float32 unless dequantise_in said
        otherwise (its slice `index` with the scale's; `part`'s rows cut from the dequantised slice, as blocks need not
        align with them)."""
        if name not in self._scales:
            return self.inner.get_tensor(name, index, part)
        weight = self.inner.get_tensor(name, index).to(self.device)
        scale = self.inner.get_tensor(self._scales[name], index).to(self.device)
        out = dequantize_blocks(weight, scale, self.block, self.dtype)
        del weight
        return out if part is None else out.chunk(part[1])[part[0]].contiguous()

    def release(self, name: str) -> None:
        self.inner.release(name)
        if name in self._scales:
            self.inner.release(self._scales[name])
