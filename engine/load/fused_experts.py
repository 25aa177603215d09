"""A checkpoint's fused experts shown one expert and one projection at a time, as every other family's.

Two families keep each layer's experts as a few tensors, `mlp.experts.gate_up_proj` and `down_proj`:
- gpt-oss: gate_up_proj [E, H, 2F] (gate and up interleaved: gate in the even columns) and down_proj [E, F, H], both
  transposed against nn.Linear, with `*_bias` beside them; the released checkpoints hold the two matrices as MXFP4
  `*_blocks` / `*_scales` instead (per output row, as nn.Linear);
- Qwen3.5/3.6-MoE as released: gate_up_proj [E, 2F, H] (gate's rows, then up's) and down_proj [E, H, F], in
  nn.Linear's layout, no biases.
`FusedExperts` names them `mlp.experts.{e}.{gate,up,down}_proj.weight` in nn.Linear's layout and the biases with
gate's before up's, so the loader, the size estimate and the executors see the layout they know. Each expert is read
alone (its slice of the fused tensor), so loading never holds a layer's whole stack twice. MXFP4 experts stay packed:
`read_packed` rearranges their bytes into kernels.quant_formats' mxfp4 rows, without dequantising.
"""
from __future__ import annotations

import re

import torch

from moedesk.engine.errors import CheckpointError
from moedesk.engine.model.architectures import text_config
from moedesk.kernels.quant_formats import FORMATS, dequantize, mxfp4_from_hf

_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_blocks|_scales|_bias)?")
_PARTS = {"gate": ("gate_up_proj", 0), "up": ("gate_up_proj", 1), "down": ("down_proj", None)}
# model_type -> how its float gate_up_proj holds gate and up (see the module's docstring)
_LAYOUTS = {"gpt_oss": "interleaved", "qwen3_5_moe": "halves"}


def fused_layout(config: dict) -> str | None:
    """"interleaved" (gpt-oss), "halves" (Qwen3.5-MoE), or None for a family whose checkpoints do not fuse experts."""
    return _LAYOUTS.get(text_config(config).get("model_type"))


def has_fused_experts(checkpoint) -> bool:
    return fused_layout(checkpoint.config) is not None and any(_FUSED.fullmatch(n) for n in checkpoint.keys())


class FusedExperts:
    """A SafetensorsCheckpoint of gpt-oss or Qwen3.5-MoE with its experts apart (see the module's docstring)."""

    def __init__(self, inner):
        self.inner = inner
        self.halves = fused_layout(inner.config) == "halves"
        self._experts = {}  # our name -> (fused stem, expert, part)
        self._biases = {}  # our name (the Hub's *_bias name) -> its fused name
        self._fused = set()
        stems = {}
        for name in inner.keys():
            if m := _FUSED.fullmatch(name):
                self._fused.add(name)
                stem, proj, kind = m.groups()
                if kind == "_bias":
                    self._biases[name] = name
                else:
                    stems.setdefault(stem, set()).add(proj + (kind or ""))
        shapes = inner_shapes(inner)
        for stem, found in stems.items():
            packed = {"gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"} <= found
            if not packed and not {"gate_up_proj", "down_proj"} <= found:
                raise CheckpointError(inner.path, f"{stem} has {', '.join(sorted(found))}: expected gate_up_proj and "
                                                  f"down_proj, or their _blocks and _scales")
            experts = shapes[f"{stem}.gate_up_proj" + ("_blocks" if packed else "")][0]
            for e in range(experts):
                for part in _PARTS:
                    self._experts[f"{stem}.{e}.{part}_proj.weight"] = (stem, e, part, packed)

    def __getattr__(self, name):  # path, config, tokenizer, tokenizer_config, close, concurrent_reads...
        return getattr(self.inner, name)

    def keys(self) -> list[str]:
        return [n for n in self.inner.keys() if n not in self._fused] + list(self._biases) + list(self._experts)

    def packed_format(self, name: str) -> str | None:
        known = self._experts.get(name)
        return "mxfp4" if known is not None and known[3] else None

    def tensor_dtype(self, name: str) -> str:
        """As SafetensorsCheckpoint.tensor_dtype; an expert's is its fused tensor's."""
        known = self._experts.get(name)
        if known is None:
            return self.inner.tensor_dtype(name)
        stem, _, part, packed = known
        return self.inner.tensor_dtype(f"{stem}.{_PARTS[part][0]}" + ("_blocks" if packed else ""))

    def release(self, name: str) -> None:
        if name not in self._experts and name not in self._biases:
            self.inner.release(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        if name in self._biases:  # [E, 2F] interleaved -> gate's then up's; down's [E, H] as it is
            bias = self.inner.get_tensor(name)
            return torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1) if "gate_up" in name else bias
        if name not in self._experts:
            return self.inner.get_tensor(name)
        stem, e, part, packed = self._experts[name]
        fused, parity = _PARTS[part]
        if packed:
            rows = self._packed_rows(stem, e, fused, parity)
            return dequantize(rows, "mxfp4", rows.shape[-1] // FORMATS["mxfp4"].block_bytes * 32)
        if self.halves:  # one expert's [F, H] rows of gate_up's [2F, H], or its down [H, F]: nn.Linear's layout
            return self.inner.get_tensor(f"{stem}.{fused}", e, None if parity is None else (parity, 2))
        w = self.inner.get_tensor(f"{stem}.{fused}", e)  # gpt-oss: one expert's [H, 2F] or [F, H]
        return (w if parity is None else w[:, parity::2]).T.contiguous()

    def read_packed(self, name: str, out: torch.Tensor) -> None:
        stem, e, part, _ = self._experts[name]
        fused, parity = _PARTS[part]
        rows = self._packed_rows(stem, e, fused, parity)
        if out.dtype != torch.uint8 or out.shape != rows.shape:
            raise CheckpointError(self.inner.path, f"{name} holds mxfp4 rows of shape {tuple(rows.shape)}, "
                                                   f"not {tuple(out.shape)}")
        out.copy_(rows)

    def _packed_rows(self, stem: str, e: int, fused: str, parity: int | None) -> torch.Tensor:
        """One expert's rows of a fused MXFP4 matrix as packed mxfp4 rows [rows, row_bytes]: the blocks are per
        output row, [rows, K / 32, 16] (gate_up's rows interleave gate and up)."""
        blocks = self.inner.get_tensor(f"{stem}.{fused}_blocks", e)
        scales = self.inner.get_tensor(f"{stem}.{fused}_scales", e)
        if parity is not None:
            blocks, scales = blocks[parity::2], scales[parity::2]
        return mxfp4_from_hf(blocks.contiguous(), scales.contiguous())


def inner_shapes(inner) -> dict:
    """{name: shape} of the fused tensors, from the safetensors headers (nothing is read)."""
    return {name: tuple(inner.get_tensor_shape(name)) for name in inner.keys() if _FUSED.fullmatch(name)}


def shapes_apart(shapes: dict, layout: str = "interleaved") -> dict:
    """{name: (shape, packed, source)} from a checkpoint's {name: shape}, under the names `FusedExperts` shows: each
    fused expert matrix becomes one entry per expert and projection (packed: MXFP4 blocks; source: the fused tensor's
    name), the rest stays (packed False, source itself). For sizing a checkpoint from its headers alone, as
    `FusedExperts` would load it; layout as `fused_layout` says."""
    apart = {}
    for name, shape in shapes.items():
        m = _FUSED.fullmatch(name)
        if m is None:
            apart[name] = (tuple(shape), False, name)
            continue
        stem, proj, kind = m.groups()
        if kind == "_bias":  # [E, 2F] or [E, H]: the same shape, gate's then up's
            apart[name] = (tuple(shape), False, name)
        elif kind == "_scales":
            continue
        else:
            packed = kind == "_blocks"
            experts = shape[0]
            if proj == "gate_up_proj":  # [E, H, 2F], blocks [E, 2F, H / 32, 16], or halves [E, 2F, H]
                width, hidden = ((shape[1] // 2, shape[2] * 32) if packed else
                                 (shape[1] // 2, shape[2]) if layout == "halves" else (shape[2] // 2, shape[1]))
                parts = {"gate": (width, hidden), "up": (width, hidden)}
            else:  # [E, F, H], blocks [E, H, F / 32, 16], or halves [E, H, F]
                parts = {"down": (shape[1], shape[2] * 32) if packed else
                         (shape[1], shape[2]) if layout == "halves" else (shape[2], shape[1])}
            for e in range(experts):
                for part, dims in parts.items():
                    apart[f"{stem}.{e}.{part}_proj.weight"] = (dims, packed, name)
    return apart
