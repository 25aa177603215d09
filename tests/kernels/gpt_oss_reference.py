"""gpt-oss's experts as transformers computes them (GptOssExperts), the reference for every kernel that runs them."""
from __future__ import annotations

import torch


def gpt_oss_experts(x, gate_up, down, gate_up_bias, down_bias, glu, sizes, dtype=torch.float64) -> torch.Tensor:
    """transformers' GptOssExperts in `dtype` on the CPU, for experts stacked as moedesk stacks them (gate_up [E, 2F, H]
    = [gate; up], down [E, H, F], biases [E, 2F] / [E, H], glu a ClampedSwiGLU), each row of x sent to its group's
    expert alone (routing weight 1, so the result is the expert's output): group g is the next sizes[g] rows.
    Checks what the function is: the layout of its fused gate/up (interleaved columns), where its biases go, its
    clamps."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    e, f2, h = gate_up.shape
    config = transformers.GptOssConfig(hidden_size=h, intermediate_size=f2 // 2, num_local_experts=e,
                                       swiglu_alpha=glu.alpha, swiglu_limit=glu.limit)
    experts = GptOssExperts(config).to(dtype)

    def interleave(t):  # [gate; up] along dim 1 -> gate 0, up 0, gate 1, up 1, ...
        return torch.stack(t.chunk(2, dim=1), dim=2).flatten(1, 2)

    with torch.no_grad():
        experts.gate_up_proj.copy_(interleave(gate_up.cpu().to(dtype)).transpose(1, 2))
        experts.gate_up_proj_bias.copy_(interleave(gate_up_bias.cpu().to(dtype)))
        experts.down_proj.copy_(down.cpu().to(dtype).transpose(1, 2))
        experts.down_proj_bias.copy_(down_bias.cpu().to(dtype))
        groups = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))[:, None]
        return experts(x.cpu().to(dtype), groups, torch.ones(groups.shape, dtype=dtype)).to(x.device)
