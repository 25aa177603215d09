"""Qwen3-Next and Qwen3.5-MoE checkpoints shown under the names and layouts moedesk's model reads.

- Qwen3-Next fuses each Gated DeltaNet layer's input projections per key head: `in_proj_qkvz` holds, for every key
  head, its q and k rows, then the v and z rows of the value heads it serves; `in_proj_ba` likewise beta's then
  the decay's rows. Qwen3.5 (and moedesk's layer) keep q, k and v of every head in `in_proj_qkv` (all q heads, all
  k heads, all v heads) and z, b and a apart. `SplitProjections` shows the fused tensors as the split ones.
- Qwen3.5-MoE's released checkpoints are multimodal: engine.load.text_model shows the text model alone.
"""
from __future__ import annotations

import re

import torch

from moedesk.engine.load.text_model import TextModel, layout_of, text_names
from moedesk.engine.model.architectures import text_config

_FUSED = re.compile(r"(.*\.linear_attn\.)in_proj_(qkvz|ba)\.weight")


def split_qkvz(fused: torch.Tensor, key_heads: int, key_dim: int, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[key_heads * (2 key_dim + 2 r value_dim), H] grouped per key head -> (qkv rows, z rows)."""
    per_head = fused.shape[0] // key_heads
    values = (per_head - 2 * key_dim) // 2
    q, k, v, z = fused.reshape(key_heads, per_head, -1).split([key_dim, key_dim, values, values], dim=1)
    flat = lambda t: t.reshape(-1, fused.shape[-1])  # noqa: E731
    return torch.cat([flat(q), flat(k), flat(v)]), flat(z)


def split_ba(fused: torch.Tensor, key_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[key_heads * 2r, H] grouped per key head -> (b rows, a rows), each [key_heads * r, H]."""
    b, a = fused.reshape(key_heads, fused.shape[0] // key_heads, -1).chunk(2, dim=1)
    return b.reshape(-1, fused.shape[-1]), a.reshape(-1, fused.shape[-1])


class SplitProjections:
    """A checkpoint whose fused `in_proj_qkvz` / `in_proj_ba` appear as in_proj_qkv, _z, _b and _a."""

    def __init__(self, inner):
        self.inner = inner
        hf = text_config(inner.config)
        self.key_heads, self.key_dim = hf["linear_num_key_heads"], hf["linear_key_head_dim"]
        self.value_dim = hf["linear_value_head_dim"]
        self._parts: dict[str, tuple[str, int]] = {}  # shown name -> (fused name, which part)
        for name in inner.keys():
            if m := _FUSED.fullmatch(name):
                stem, kind = m.groups()
                for i, part in enumerate(("qkv", "z") if kind == "qkvz" else ("b", "a")):
                    self._parts[f"{stem}in_proj_{part}.weight"] = (name, i)
        self._fused = {name for name, _ in self._parts.values()}

    def __getattr__(self, name):  # path, config, tokenizer, tokenizer_config, close, packed_format...
        return getattr(self.inner, name)

    def keys(self) -> list[str]:
        return [n for n in self.inner.keys() if n not in self._fused] + list(self._parts)

    def shapes(self):
        shapes = self.inner.shapes()
        if shapes is None:
            return None
        out = {name: shape for name, shape in shapes.items() if name not in self._fused}
        for name, (fused, part) in self._parts.items():
            rows, cols = shapes[fused]
            if fused.endswith("qkvz.weight"):
                z_rows = (rows // self.key_heads - 2 * self.key_dim) // 2 * self.key_heads
                out[name] = (rows - z_rows if part == 0 else z_rows, cols)
            else:
                out[name] = (rows // 2, cols)
        return out

    def release(self, name: str) -> None:
        if name not in self._parts:
            getattr(self.inner, "release", lambda _: None)(name)

    def get_tensor(self, name: str, *args) -> torch.Tensor:
        if name not in self._parts:
            return self.inner.get_tensor(name, *args)
        fused, part = self._parts[name]
        tensor = self.inner.get_tensor(fused)
        if fused.endswith("qkvz.weight"):
            return split_qkvz(tensor, self.key_heads, self.key_dim, self.value_dim)[part].contiguous()
        return split_ba(tensor, self.key_heads)[part].contiguous()


def shapes_as_read(config: dict, shapes: dict[str, tuple]) -> dict[str, tuple[tuple, str]]:
    """What `as_the_model_reads_it` shows, from tensor shapes alone (the size estimate's view of a checkpoint):
    {shown name: (shape, the checkpoint's name it comes from)}."""
    layout = layout_of(config, shapes)
    names = text_names(layout, shapes) if layout is not None else {name: name for name in shapes}
    shown = {}
    for ours, name in names.items():
        shape = shapes[name]
        if m := _FUSED.fullmatch(ours):
            hf = text_config(config)
            rows, cols = shape
            if m.group(2) == "qkvz":
                z_rows = (rows // hf["linear_num_key_heads"] - 2 * hf["linear_key_head_dim"]) // 2 * hf[
                    "linear_num_key_heads"]
                shown[m.group(1) + "in_proj_qkv.weight"] = ((rows - z_rows, cols), name)
                shown[m.group(1) + "in_proj_z.weight"] = ((z_rows, cols), name)
            else:
                for part in ("b", "a"):
                    shown[f"{m.group(1)}in_proj_{part}.weight"] = ((rows // 2, cols), name)
            continue
        shown[ours] = (tuple(shape), name)
    return shown


def as_the_model_reads_it(checkpoint):
    """`checkpoint` under the text model's names, with fused DeltaNet projections split, where it needs either."""
    hf = checkpoint.config
    if (layout := layout_of(hf, checkpoint.keys())) is not None:
        checkpoint = TextModel(checkpoint, layout)
    if text_config(hf).get("model_type") in ("qwen3_next", "qwen3_5_moe") and any(
            _FUSED.fullmatch(n) for n in checkpoint.keys()):
        checkpoint = SplitProjections(checkpoint)
    return checkpoint
