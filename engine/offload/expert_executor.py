"""The expert executor: what the model hands every MoE layer's tokens to (`ExpertExecutor`), and the simplest one.

An executor computes each (token, expert) pair's output; the model weights and sums them
(`MoE.combine`). `LocalExecutor` runs each expert on the device that holds its weights, one
expert after another; the CPU-GPU orchestration (placement, copies, parallel CPU work) plugs
in as `engine.offload.offload_executor.OffloadExecutor`, with the same one method.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moedesk.kernels.experts import expert_forward, experts_forward_routed


@dataclass
class HostRouting:
    """A step's routing on its way to pinned host memory, queued by the caller (CUDA graphs copy it
    there inside the graph): x [N, H] and ids [N, K], valid once `ready.synchronize()` returned (a CUDA
    event, or a layer's flag of kernels.host_handoff).
    zero_copy: the caller has the GPU compute each token's last `zero_copy` ranks itself, from the
    experts' pinned host copies (engine.offload.offload_executor.OffloadExecutor.zero_copy_experts), into `out`.
    cpu_width: the host computes only each expert's first `cpu_width` intermediate rows; the caller has the GPU
    compute the rest (OffloadExecutor.zero_copy_width) and adds the two (0: every row)."""

    x: torch.Tensor
    ids: torch.Tensor
    ready: Any = None  # torch.cuda.Event, or anything else with synchronize()
    zero_copy: int = 0
    cpu_width: int = 0


class ExpertExecutor(Protocol):
    def expert_outputs(self, moe, x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None,
                       host: HostRouting | None = None) -> torch.Tensor:
        """[N*K, H]: row t*K + r is expert ids[t, r] applied to x[t], for x [N, H] and ids [N, K] (each row
        in ascending expert order, as MoE.route gives them). out: where to write it; host: the same routing
        already copied to the host, for executors that need it there."""


class LocalExecutor:
    """Every active expert in turn, in ascending id order, where its weights live; on the CPU, a layer's packed or
    bfloat16 experts in one call of their native kernel (kernels.experts.experts_forward_routed).

    Counts how often each (layer, expert) was selected: the popularity that placement uses.
    """

    def __init__(self):
        self.selections: dict[int, torch.Tensor] = {}

    def expert_outputs(self, moe, x, ids, out=None, host=None):
        k = ids.shape[1]
        pair_expert = ids.flatten()
        counts = torch.bincount(pair_expert, minlength=moe.experts.num_experts).cpu()
        seen = self.selections.get(moe.layer)
        self.selections[moe.layer] = counts if seen is None else seen + counts
        if out is None:
            out = x.new_empty((pair_expert.shape[0], x.shape[1]))
        w = moe.experts
        if w.packed and x.is_cpu:  # a CPU load's packed experts: one routed call (the native kernel where it applies)
            return experts_forward_routed(x, pair_expert, k, None, w, out)
        if not w.packed and w.dense_dtype != x.dtype:  # a float32 CPU load's bfloat16 experts: the kernel's call
            ours = experts_forward_routed(x.to(w.dense_dtype), pair_expert.cpu(), k, None, w,
                                          x.new_empty(out.shape, dtype=w.dense_dtype))
            return out.copy_(ours)
        for e in torch.nonzero(counts).flatten().tolist():
            pairs = torch.nonzero(pair_expert == e).flatten()
            out[pairs] = expert_forward(x[pairs // k], w.expert(e))
        return out
