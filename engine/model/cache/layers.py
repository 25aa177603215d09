"""A model's cache made of several kinds, each serving some of its layers (engine.model.cache).

gpt-oss alternates sliding-window and full attention layers; Qwen3-Next puts Gated DeltaNet layers beside full
attention. Their cache is a `LayerCaches`: a layer finds its own kind with `caches[layer]`, and the row operations
(growing, forking, accepting) reach every kind at once.
"""
from __future__ import annotations

from typing import Sequence


class LayerCaches:
    """Several cache kinds behind the one interface; each layer belongs to exactly one."""

    def __init__(self, kinds: Sequence):
        self.kinds = list(kinds)
        self.of: dict[int, object] = {}
        for kind in self.kinds:
            for layer in kind.layers:
                if layer in self.of:
                    raise ValueError(f"layer {layer} has two caches")
                self.of[layer] = kind
        self.device = self.kinds[0].device

    def __getitem__(self, layer: int):
        return self.of[layer]

    @property
    def layers(self) -> list[int]:
        """The model layers it serves: a LayerCaches may itself be one kind of another (a device's layers)."""
        return sorted(self.of)

    def write_and_read(self, layer: int, *args, **kwargs):
        """An attention layer's write and read, by the kind serving it (a KV cache)."""
        return self.of[layer].write_and_read(layer, *args, **kwargs)

    @property
    def stateful(self) -> bool:
        """Whether a forward run twice changes what it holds twice (a recurrent state among its kinds)."""
        return any(getattr(kind, "stateful", False) for kind in self.kinds)

    def save(self, rows, batch: int) -> list:
        """Each stateful kind's `save` of these rows (None: 0..batch-1), for `restore`."""
        return [(kind, kind.save(rows if rows is None else rows.to(kind.device), batch))
                for kind in self.kinds if getattr(kind, "stateful", False)]

    def restore(self, saved: list) -> None:
        for kind, state in saved:
            kind.restore(state)

    @property
    def rows(self) -> int:
        return min(kind.rows for kind in self.kinds)

    @property
    def length(self) -> int:
        return min(kind.length for kind in self.kinds)

    def ensure(self, rows: int, length: int) -> None:
        for kind in self.kinds:
            kind.ensure(rows, length)

    def shrink(self, rows: int, length: int) -> None:
        for kind in self.kinds:
            kind.shrink(rows, length)

    def nbytes(self) -> int:
        return sum(kind.nbytes() for kind in self.kinds)

    def bytes_per_position(self) -> int:
        return sum(kind.bytes_per_position() for kind in self.kinds)

    def bytes_per_row(self) -> int:
        return sum(kind.bytes_per_row() for kind in self.kinds)

    def storage_key(self) -> tuple:
        return tuple(kind.storage_key() for kind in self.kinds)

    def reorder(self, block: list[int], source: list[int], length: int) -> None:
        for kind in self.kinds:
            kind.reorder(block, source, length)

    def accept(self, rows: list[int], starts: list[int], paths: list[list[int]]) -> None:
        for kind in self.kinds:
            kind.accept(rows, starts, paths)


def own_kind(cache, layer: int):
    """The kind that holds `layer`'s entries: `cache` itself, or the innermost one serving it inside LayerCaches
    (a model's kinds, and within them a device's layers), for the decode kernels that read it in place."""
    while isinstance(cache, LayerCaches):
        cache = cache[layer]
    return cache
