"""A multimodal checkpoint's text model, under the names a text-only checkpoint of its architecture has.

Qwen3.5-MoE and Kimi-K2.5 ship a vision tower beside their language model, whose own config nests as `text_config`
(engine.model.architectures.text_config reads it). moedesk runs the text model only: `TextModel` shows its tensors
under `model.` / `lm_head.` and hides the rest, so that the loader and the size estimate see an ordinary checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    renamed: tuple[tuple[str, str], ...]  # (the checkpoint's prefix, a text-only checkpoint's) for the text model
    hidden: tuple[str, ...]  # prefixes of what moedesk does not run: the vision tower, multi-token prediction


LAYOUTS = {
    # model.language_model.* and model.visual.*; the multi-token prediction layers under mtp.
    "qwen3_5_moe": Layout((("model.language_model.", "model."),), ("model.visual.", "mtp.")),
    # Moonshot's release: language_model.model.* and language_model.lm_head.*, the vision tower and its projector
    # beside them (transformers keeps the projector's norm under model.mm_projector).
    "kimi_k25": Layout((("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
                       ("vision_tower.", "mm_projector.", "model.mm_projector.")),
}


def layout_of(config: dict, names) -> Layout | None:
    """The layout to undo for a checkpoint of this config.json whose tensors are `names`; None where it has none."""
    layout = LAYOUTS.get(config.get("model_type"))
    if layout is None:
        return None
    prefixes = tuple(p for p, _ in layout.renamed) + layout.hidden
    return layout if any(n.startswith(prefixes) for n in names) else None


def text_names(layout: Layout, names) -> dict[str, str]:
    """{the text-only name: the checkpoint's} for each tensor of the text model (hidden ones left out)."""
    shown = {}
    for name in names:
        if name.startswith(layout.hidden):
            continue
        ours = next((new + name[len(old):] for old, new in layout.renamed if name.startswith(old)), name)
        shown[ours] = name
    return shown


class TextModel:
    """A multimodal checkpoint (see `LAYOUTS`) as its text model alone, under text-only names."""

    def __init__(self, inner, layout: Layout):
        self.inner = inner
        self._names = text_names(layout, inner.keys())

    def __getattr__(self, name):  # path, config, tokenizer, tokenizer_config, close...
        return getattr(self.inner, name)

    def keys(self) -> list[str]:
        return list(self._names)

    def shapes(self):
        shapes = self.inner.shapes()
        return None if shapes is None else {ours: shapes[theirs] for ours, theirs in self._names.items()}

    def get_tensor(self, name: str, *args) -> torch.Tensor:
        return self.inner.get_tensor(self._names.get(name, name), *args)

    def release(self, name: str) -> None:
        getattr(self.inner, "release", lambda _: None)(self._names.get(name, name))

    def get_tensor_shape(self, name: str) -> list[int]:
        return self.inner.get_tensor_shape(self._names.get(name, name))

    def packed_format(self, name: str):
        return self.inner.packed_format(self._names.get(name, name))

    def tensor_dtype(self, name: str) -> str:
        return self.inner.tensor_dtype(self._names.get(name, name))

    def read_packed(self, name: str, out) -> None:
        self.inner.read_packed(self._names.get(name, name), out)

    def released_as(self, name: str) -> str | None:
        released_as = getattr(self.inner, "released_as", None)
        return None if released_as is None else released_as(self._names.get(name, name))
