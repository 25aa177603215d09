"""Turn an opened checkpoint into a Transformer on a device, tensor by tensor."""
from __future__ import annotations

import torch
from torch import nn

from engine.architectures import is_ignored_tensor, map_weight_name, parse_config, weight_name_map
from engine.config import ModelConfig
from engine.errors import CheckpointError, MoedeskError, UnsupportedModelError
from engine.model import Rotary, Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MoedeskError(f"--device {device}: no CUDA GPU is available")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        # 16-bit matmuls are slow on most CPUs; GPUs want bfloat16 where they have it.
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in DTYPES:
        raise MoedeskError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(checkpoint, dtype: torch.dtype, device: torch.device, context_length: int | None = None,
               progress=None, expert_banks=None) -> tuple[Transformer, ModelConfig, dict]:
    """Build the model on the meta device, then fill it with the checkpoint's tensors one at a time.

    expert_banks(model) -> banks, when given, allocates host stacks for the routed experts
    (engine.offload.allocate_banks): expert tensors are written straight into them and only the
    rest goes to `device`. Returns (model, config, banks); banks is {} without expert_banks.
    """
    path = checkpoint.path
    cfg = parse_config(checkpoint.config, path)
    max_positions = min(context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
    with torch.device("meta"):
        model = Transformer(cfg, max_positions)
    banks = expert_banks(model) if expert_banks and cfg.is_moe else {}
    expected = dict(model.named_parameters())
    rules = weight_name_map(cfg)
    names = [n for n in checkpoint.keys() if not is_ignored_tensor(n)]
    loaded = set()
    for i, name in enumerate(names):
        ours = map_weight_name(rules, name)
        if ours is None or ours not in expected:
            raise UnsupportedModelError(path, f"unexpected tensor {name} for a {cfg.arch} model")
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        tensor = checkpoint.get_tensor(name)
        if tuple(tensor.shape) != tuple(expected[ours].shape):
            raise CheckpointError(path, f"tensor {name} has shape {tuple(tensor.shape)}, "
                                        f"the config implies {tuple(expected[ours].shape)}")
        target = expected[ours]
        if target.device.type == "meta":
            _set_parameter(model, ours, tensor.to(device=device, dtype=dtype))
        else:  # a view into a host expert bank
            target.copy_(tensor)
        loaded.add(ours)
        if progress:
            progress("load", (i + 1) / len(names))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(expected) - loaded)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(path, f"missing tensors: {', '.join(missing[:3])}{more}")
    model.rotary = Rotary(cfg, max_positions).to(device)
    return model.eval(), cfg, banks


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, leaf, nn.Parameter(tensor, requires_grad=False))
