"""llama.cpp's compute buffer on the GPU, estimated from a GGUF's tensor shapes before anything is loaded.

Beside the weights and the KV cache, llama.cpp reserves one buffer for the graph of a whole micro-batch (n_ubatch
tokens, 512 by default, which the engine keeps): f32 activations, of which the widest are the output logits (every
token's, at reservation) or a feed-forward's intermediates, and the attention mask over the context. Where some
layers' experts stay in RAM, its CUDA backend computes a prefill's expert products on the GPU all the same, copying
the weight there first: the copy lives in the compute buffer, one tensor at a time (each in its own graph split),
beside the activations live at that product, and is freed after it like any other node. Pure functions of sizes,
checked against llama.cpp's own "compute buffer size" lines (tests/llamacpp/test_compute_buffer.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

UBATCH = 512  # llama.cpp's default micro-batch (n_ubatch), which engine.llamacpp.decoder keeps
OFFLOAD_BATCH = 32  # from this many tokens on, llama.cpp's CUDA backend runs an op on a weight in RAM itself
_ROUTED = re.compile(r"blk\.\d+\.ffn_(gate|up|gate_up)_(?:ch)?exps\.weight$")
_DENSE = re.compile(r"blk\.\d+\.ffn_(gate|up)(_shexp)?\.weight$")
_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down|gate_up)_(?:ch)?exps\.")


@dataclass(frozen=True)
class GraphShape:
    """What the size of llama.cpp's graph depends on, from the GGUF's tensors."""

    vocab: int
    hidden: int
    ffn_floats: int  # floats per token that the widest feed-forward holds at once
    routed_floats: int  # floats per token of one routed projection over every pick (picks x expert width)
    picks: int  # routed experts a token runs
    gate_up_bytes: int  # the largest routed gate or up (or fused gate_up) tensor: a pinned layer's copy
    down_bytes: int  # the largest routed down tensor


def graph_shape(tensors, experts_used: int) -> GraphShape:
    """tensors: objects with .name, .shape (GGUF order: fastest dimension first) and .n_bytes, as gguf's reader
    and engine.load.gguf_header give them; experts_used: the routers' picks per token (0: a dense model)."""
    vocab = hidden = gate_up = down = 0
    routed: dict[str, int] = {}  # per layer: the expert width, counted once for gate and up
    dense: dict[str, int] = {}  # per layer: dense and shared-expert widths
    for t in tensors:
        name, shape = t.name, [int(n) for n in t.shape]
        if name == "token_embd.weight" and len(shape) == 2:
            hidden, vocab = shape
        if m := _EXPERT.match(name):
            if m.group(1) == "down":
                down = max(down, int(t.n_bytes))
            else:
                gate_up = max(gate_up, int(t.n_bytes))
        layer = name.split(".")[1] if name.startswith("blk.") else ""
        if (m := _ROUTED.match(name)) and len(shape) == 3:
            routed[layer] = shape[1] // (2 if m.group(1) == "gate_up" else 1)
        elif (m := _DENSE.match(name)) and len(shape) == 2:
            dense[layer + (m.group(2) or "")] = shape[1]
    # Per routed pick: gate, up and their product, and the down projection's output; a dense block the same once.
    # A shared expert runs beside the routed ones, so its width adds to theirs.
    per_layer = [max(1, experts_used) * (3 * width + hidden) + 3 * dense.get(layer + "_shexp", 0)
                 for layer, width in routed.items()]
    per_layer += [3 * width + hidden for key, width in dense.items() if not key.endswith("_shexp")]
    picks = max(1, experts_used) if routed else 0
    return GraphShape(vocab, hidden, max(per_layer, default=0), picks * max(routed.values(), default=0), picks,
                      gate_up, down)


def micro_batch(context: int, ubatch: int = UBATCH) -> int:
    """The tokens llama.cpp sizes its graph for: a micro-batch, never more than the context holds."""
    return min(ubatch, context)


def activation_bytes(shape: GraphShape, context: int, ubatch: int = UBATCH) -> int:
    """The graph's f32 activations at the widest point, over the attention mask (f32 and its f16 copy) of a
    micro-batch against `context` positions."""
    tokens = micro_batch(context, ubatch)
    per_token = max(shape.vocab + 2 * shape.hidden, shape.ffn_floats + 3 * shape.hidden)
    return 4 * tokens * per_token + _mask_bytes(tokens, context)


def _mask_bytes(tokens: int, context: int) -> int:
    """The attention mask of a micro-batch against the context: f32, and its f16 copy."""
    return 6 * tokens * context


def offload_copy_bytes(shape: GraphShape, context: int, ubatch: int = UBATCH) -> int:
    """How much more the GPU's compute buffer holds when some layers' experts stay in RAM. Its peak is then either
    the copy of one expert tensor with what is live at that product (beside the up projection's copy: the gate's
    and up's outputs for every pick; beside the down's: its input and output for every pick), or the graph's own
    widest point with the hole a copy leaves where it is too small for the routed outputs to reuse."""
    tokens = micro_batch(context, ubatch)
    if tokens < OFFLOAD_BATCH or not shape.picks:
        return 0
    # The layer's input and its normalised copy, and three rows more: llama.cpp's own figure sat 1-7 MiB above the
    # two alone on each file measured (tests/llamacpp/test_compute_buffer.py).
    beside = 5 * shape.hidden
    at_up = shape.gate_up_bytes + 4 * tokens * (2 * shape.routed_floats + beside)
    at_down = shape.down_bytes + 4 * tokens * (shape.routed_floats + shape.picks * shape.hidden + beside)
    widest = activation_bytes(shape, context, ubatch)
    copy = max(shape.gate_up_bytes, shape.down_bytes)
    hole = copy if copy < 4 * tokens * shape.routed_floats else 0
    return max(0, max(at_up, at_down) + _mask_bytes(tokens, context) - widest, hole)
