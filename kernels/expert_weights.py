"""`ExpertWeights`: one MoE layer's routed experts, stacked, in 16-bit (or float32) or a packed format.

Every SwiGLU expert e is two matrices: gate_up[e] = [gate; up] ([2F, H]) and down[e] ([H, F]).
Dense stacks hold them as [E, 2F, H] and [E, H, F] in a float dtype. Packed stacks hold each row as
the blocks of a GGUF quantisation (kernels.quant_formats): [E, 2F, row_bytes(H)] and
[E, H, row_bytes(F)] of uint8. gate_up and down may be packed differently (a Q4_K_M file keeps some
layers' down projections in q6_k); gate and up share one format, since they are one matrix here.

This is the one type that carries experts from the loader through placement, the executors and the
kernels: copying an expert to the GPU copies its bytes as they are (a 4-bit expert crosses PCIe in
a quarter of the time), and each kernel dispatches on `gate_up_format` / `down_format`.

gpt-oss's experts compute more than SwiGLU: a bias after each matrix and a clamped activation
(`ClampedSwiGLU`). They ride along here (`gate_up_bias`, `down_bias`, `glu`) so that every executor carries
them wherever the weights go; `plain` says whether an expert is the SwiGLU every native kernel computes. The
packed CPU kernel computes gpt-oss's function too (kernels.cpu_quant); kernels.experts sends the other non-plain
stacks to its reference path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moedesk.kernels.quant_formats import dequantize, packed_format

DENSE = "dense"  # the tensors' own float dtype


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), where g = min(gate, limit)."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass
class ExpertWeights:
    gate_up: torch.Tensor
    down: torch.Tensor
    hidden: int  # H
    width: int  # F, one expert's intermediate size
    gate_up_format: str = DENSE
    down_format: str = DENSE
    gate_up_bias: torch.Tensor | None = None  # [E, 2F], gate's then up's, added before the activation
    down_bias: torch.Tensor | None = None  # [E, H]
    glu: ClampedSwiGLU | None = None  # None: silu(gate) * up

    def __post_init__(self):
        E = self.gate_up.shape[0]
        expect_gu = (E, 2 * self.width, self._cols(self.gate_up_format, self.hidden))
        expect_d = (E, self.hidden, self._cols(self.down_format, self.width))
        if tuple(self.gate_up.shape) != expect_gu or tuple(self.down.shape) != expect_d:
            raise ValueError(f"expert stacks of shape {tuple(self.gate_up.shape)} / {tuple(self.down.shape)} "
                             f"do not fit {self.gate_up_format}/{self.down_format} experts of H={self.hidden}, "
                             f"F={self.width} (expected {expect_gu} / {expect_d})")
        for fmt, t in ((self.gate_up_format, self.gate_up), (self.down_format, self.down)):
            if (fmt == DENSE) == (t.dtype == torch.uint8):
                raise ValueError(f"a {fmt} stack cannot be {t.dtype}")

    @staticmethod
    def _cols(fmt: str, k: int) -> int:
        return k if fmt == DENSE else packed_format(fmt).row_bytes(k)

    @classmethod
    def empty(cls, experts: int, hidden: int, width: int, *, dtype: torch.dtype, gate_up_format: str = DENSE,
              down_format: str = DENSE, device=None, pin_memory: bool = False) -> "ExpertWeights":
        def stack(fmt, rows, k):
            t = dtype if fmt == DENSE else torch.uint8
            return torch.empty((experts, rows, cls._cols(fmt, k)), dtype=t, device=device, pin_memory=pin_memory)
        return cls(stack(gate_up_format, 2 * width, hidden), stack(down_format, hidden, width), hidden, width,
                   gate_up_format, down_format)

    # ------------------------------------------------------------------------ what it is

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def plain(self) -> bool:
        """Whether each expert is down(silu(gate x) * up x), what the native kernels compute."""
        return self.gate_up_bias is None and self.down_bias is None and self.glu is None

    def with_function(self, gate_up_bias=None, down_bias=None, glu=None) -> "ExpertWeights":
        """These stacks computing with biases and/or another activation (gpt-oss's experts)."""
        return ExpertWeights(self.gate_up, self.down, self.hidden, self.width, self.gate_up_format,
                             self.down_format, gate_up_bias, down_bias, glu)

    @property
    def packed(self) -> bool:
        return self.gate_up_format != DENSE or self.down_format != DENSE

    @property
    def dense_dtype(self) -> torch.dtype | None:
        """The float dtype of a dense stack (None when both halves are packed)."""
        for fmt, t in ((self.gate_up_format, self.gate_up), (self.down_format, self.down)):
            if fmt == DENSE:
                return t.dtype
        return None

    @property
    def device(self) -> torch.device:
        return self.gate_up.device

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert as stored: what a copy moves and what the CPU reads to compute it."""
        return (self.gate_up[0].numel() * self.gate_up.element_size()
                + self.down[0].numel() * self.down.element_size())

    @property
    def nbytes(self) -> int:
        return self.expert_bytes * self.num_experts

    def describe(self) -> str:
        if not self.packed:
            return str(self.gate_up.dtype).removeprefix("torch.")
        if self.gate_up_format == self.down_format:
            return self.gate_up_format
        return f"{self.gate_up_format}/{self.down_format}"

    def is_pinned(self) -> bool:
        return self.gate_up.is_pinned() and self.down.is_pinned()

    # ------------------------------------------------------------------------ views and copies

    def _like(self, gate_up: torch.Tensor, down: torch.Tensor, each=lambda t: t) -> "ExpertWeights":
        """New stacks of the same kind; `each` makes the biases' counterparts of gate_up and down."""
        return ExpertWeights(gate_up, down, self.hidden, self.width, self.gate_up_format, self.down_format,
                             None if self.gate_up_bias is None else each(self.gate_up_bias),
                             None if self.down_bias is None else each(self.down_bias), self.glu)

    def pin_memory(self) -> "ExpertWeights":
        """A copy in page-locked host memory, biases and activation kept (copies to a GPU read it at full speed)."""
        return self._like(self.gate_up.pin_memory(), self.down.pin_memory(), lambda t: t.pin_memory())

    def expert(self, e: int) -> "ExpertWeights":
        """Expert e alone, as a one-expert stack viewing the same memory."""
        return self._like(self.gate_up[e:e + 1], self.down[e:e + 1], lambda t: t[e:e + 1])

    def span(self, start: int, stop: int) -> "ExpertWeights":
        """Experts [start, stop) as a stack viewing the same memory (a run of staging slots, a run of ids)."""
        return self._like(self.gate_up[start:stop], self.down[start:stop], lambda t: t[start:stop])

    def select(self, index) -> "ExpertWeights":
        """A new stack of the experts in `index` (a list or tensor of ids), in that order."""
        index = torch.as_tensor(index, dtype=torch.int64)
        return self._like(self.gate_up[index], self.down[index], lambda t: t[index.to(t.device)])

    def to(self, device, non_blocking: bool = False) -> "ExpertWeights":
        return self._like(self.gate_up.to(device, non_blocking=non_blocking),
                          self.down.to(device, non_blocking=non_blocking),
                          lambda t: t.to(device, non_blocking=non_blocking))

    def empty_like(self, device=None, experts: int | None = None) -> "ExpertWeights":
        """Uninitialised stacks of this kind on `device`, of `experts` experts (None: as many as this one has)."""
        def like(t):
            shape = t.shape if experts is None else (experts, *t.shape[1:])
            return torch.empty(shape, dtype=t.dtype, device=t.device if device is None else device)
        return self._like(like(self.gate_up), like(self.down), like)

    def copy_experts_(self, at: int, source: "ExpertWeights", start: int, count: int,
                      non_blocking: bool = False) -> None:
        """Experts [start, start + count) of `source`, biases included, into this stack's [at, at + count): the
        tensors sliced here rather than two stacks built and checked (`span`), as a prefill's copy runs queue dozens
        of such copies a layer on the host."""
        for mine, theirs in ((self.gate_up, source.gate_up), (self.down, source.down),
                             (self.gate_up_bias, source.gate_up_bias), (self.down_bias, source.down_bias)):
            if mine is not None:
                mine[at:at + count].copy_(theirs[start:start + count], non_blocking=non_blocking)

    def copy_(self, other: "ExpertWeights", non_blocking: bool = False) -> "ExpertWeights":
        self.copy_experts_(0, other, 0, self.num_experts, non_blocking)
        return self

    def dense(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2F, H], down [E, H, F]) as float tensors: the packed halves dequantised (the reference
        arithmetic), dense ones as they are (cast to `dtype` when given)."""
        dtype = dtype or self.dense_dtype or torch.float32
        gate_up = (self.gate_up if self.gate_up_format == DENSE
                   else dequantize(self.gate_up, self.gate_up_format, self.hidden))
        down = self.down if self.down_format == DENSE else dequantize(self.down, self.down_format, self.width)
        return gate_up.to(dtype), down.to(dtype)
