"""RMS normalisation, the norm of every supported architecture: the transformer's layers and MLA's latent
projections both use it."""
from __future__ import annotations

import torch
from torch import nn

from moedesk.kernels import gpu_fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_first: bool = False,
             offset: bool = False) -> torch.Tensor:
    # Normalise in float32 and cast back before the weight, as the reference implementations do,
    # so that 16-bit runs round at the same places. weight_first: gpt-oss's reference applies the weight in
    # float32 and rounds after it. offset: Qwen3-Next's scales by 1 + weight, in float32, then rounds.
    if gpu_fused.applies(x, weight):
        return gpu_fused.rms_norm(x, weight, eps, weight_first, offset)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x32 * (1.0 + weight.float())).to(dtype)
    if weight_first:
        return (weight.float() * x32).to(dtype)
    return weight * x32.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_first: bool = False, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.weight_first = weight_first
        self.offset = offset

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, self.weight_first, self.offset)
