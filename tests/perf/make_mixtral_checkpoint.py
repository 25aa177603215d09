"""Write a random-weight Mixtral-8x7B-shaped Hugging Face checkpoint: the first L layers, sharded safetensors,
config.json, tokenizer.json and tokenizer_config.json (with a chat template), loadable by `--model DIR`.

Usage (repo root): python3 tests/perf/make_mixtral_checkpoint.py OUT_DIR [--layers 8] [--shard-gb 5] [--tiny]

The real model's tensor names and shapes (model.layers.N.block_sparse_moe.experts.E.w1/w2/w3, 32 query and
8 key/value heads of 128, 8 experts of 4096x14336, vocabulary 32000), bfloat16: 8 layers are 23.7 GB in
5 shards. Weights tile one random block from a per-tensor offset (speed and the load path do not depend on
the values, and tiling writes at disk speed), router weights are random at a scale that spreads routing
like a trained model's (as engine/load/synthetic.py does), norms are ones. Only one shard is in memory at a time.
The tokenizer is a byte-level BPE trained on this repository's text, its vocabulary padded with placeholder
tokens to the model's 32000, so `moedesk serve` and `moedesk batch` take text as they would for the real
model. --tiny writes the same architecture at toy sizes in a second, for the CPU smoke runs
(tests/perf/bench_serve.py --smoke).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
FULL = dict(vocab=32000, hidden=4096, inter=14336, heads=32, kv_heads=8, experts=8, top_k=2)
TINY = dict(vocab=512, hidden=64, inter=128, heads=4, kv_heads=2, experts=8, top_k=2)
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                 "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
                 "{{ message['content'] + eos_token }}{% else %}{{ message['content'] + '\n\n' }}{% endif %}"
                 "{% endfor %}")


def tensors(shape: dict, layers: int):
    """(name, shape, kind) of every tensor, in the order a checkpoint lists them; kind: weight, router or norm."""
    H, F, V, E = shape["hidden"], shape["inter"], shape["vocab"], shape["experts"]
    head_dim = H // shape["heads"]
    yield "model.embed_tokens.weight", (V, H), "weight"
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (H,), "norm"
        yield p + "self_attn.q_proj.weight", (shape["heads"] * head_dim, H), "weight"
        yield p + "self_attn.k_proj.weight", (shape["kv_heads"] * head_dim, H), "weight"
        yield p + "self_attn.v_proj.weight", (shape["kv_heads"] * head_dim, H), "weight"
        yield p + "self_attn.o_proj.weight", (H, shape["heads"] * head_dim), "weight"
        yield p + "post_attention_layernorm.weight", (H,), "norm"
        yield p + "block_sparse_moe.gate.weight", (E, H), "router"
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            yield q + "w1.weight", (F, H), "weight"
            yield q + "w2.weight", (H, F), "weight"
            yield q + "w3.weight", (F, H), "weight"
    yield "model.norm.weight", (H,), "norm"
    yield "lm_head.weight", (V, H), "weight"


class Filler:
    """Tensors cut from one random block, each from its own offset, so no two are alike."""

    def __init__(self, dtype, seed: int = 0, block: int = 1 << 24):
        gen = torch.Generator().manual_seed(seed)
        self.block = (torch.randn(block, generator=gen) * 0.02).to(dtype)
        self.twice = torch.cat([self.block, self.block])
        self.gen, self.dtype = gen, dtype
        self.count = 0

    def make(self, shape, kind: str) -> torch.Tensor:
        if kind == "norm":
            return torch.ones(shape, dtype=self.dtype)
        if kind == "router":
            return torch.randn(shape, generator=self.gen).to(self.dtype)
        out = torch.empty(shape, dtype=self.dtype)
        flat, n = out.view(-1), self.block.numel()
        self.count += 1
        offset = (self.count * 7919 * 64) % n
        for start in range(0, flat.numel(), n):
            k = min(n, flat.numel() - start)
            flat[start:start + k].copy_(self.twice[offset:offset + k])
        return out


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [p.read_text(errors="ignore") for p in [REPO / "README.md", REPO / "assets" / "calibration.txt"]
              if p.exists()]
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 8000), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus or ["hello world"], trainer)
    model = json.loads(tok.to_str())["model"]
    vocab, merges = dict(model["vocab"]), [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                                           for m in model["merges"]]
    # The model's vocabulary is larger than what the corpus teaches: placeholders fill it, so every id the model
    # can emit decodes to something.
    filler = 0
    while len(vocab) < vocab_size:
        name = f"<x{filler}>"
        filler += 1
        if name not in vocab:
            vocab[name] = len(vocab)
    full = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    full.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    full.decoder = decoders.ByteLevel()
    full.add_special_tokens(specials)
    full.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE}, indent=1))


def write_config(out: Path, shape: dict, layers: int, dtype: str) -> None:
    H = shape["hidden"]
    (out / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": shape["vocab"],
        "hidden_size": H, "intermediate_size": shape["inter"], "num_hidden_layers": layers,
        "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"],
        "head_dim": H // shape["heads"], "hidden_act": "silu", "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None, "num_local_experts": shape["experts"],
        "num_experts_per_tok": shape["top_k"], "router_aux_loss_coef": 0.02, "output_router_logits": False,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True}, indent=1))


def write_checkpoint(out: Path, layers: int = 8, tiny: bool = False, shard_gb: float = 5.0,
                     dtype: str = "bfloat16", log=print) -> int:
    """Write the checkpoint into `out`; returns its weights' bytes."""
    out.mkdir(parents=True, exist_ok=True)
    shape = TINY if tiny else FULL
    torch_dtype = getattr(torch, dtype)
    filler = Filler(torch_dtype)
    limit = int(shard_gb * 1e9) if not tiny else 1 << 20  # the tiny one is sharded too, to test the index
    specs = list(tensors(shape, layers))
    shards: list[list[tuple[str, tuple, str]]] = [[]]
    size = 0
    for name, dims, kind in specs:
        nbytes = torch_dtype.itemsize * int(torch.Size(dims).numel())
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, dims, kind))
        size += nbytes
    weight_map, total, started = {}, 0, time.perf_counter()
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        data = {name: filler.make(dims, kind) for name, dims, kind in shard}
        save_file(data, str(out / file), metadata={"format": "pt"})
        nbytes = sum(t.numel() * t.element_size() for t in data.values())
        total += nbytes
        weight_map.update({name: file for name in data})
        del data
        log(f"{file}: {nbytes / 1e9:.2f} GB ({time.perf_counter() - started:.0f} s)")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    write_config(out, shape, layers, dtype)
    write_tokenizer(out, shape["vocab"])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shard-gb", type=float, default=5.0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tiny", action="store_true", help="toy sizes, same architecture (CPU smoke runs)")
    args = parser.parse_args()
    total = write_checkpoint(args.out, args.layers, args.tiny, args.shard_gb, args.dtype)
    print(f"{args.out}: {total / 1e9:.2f} GB of weights, {args.layers} layers")


if __name__ == "__main__":
    main()
