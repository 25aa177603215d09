"""Memory of a packed model, measured: loading a few-hundred-MB checkpoint (a GGUF with q4_0 or q4_k experts, a
16-bit safetensors folder as stored or with its experts quantised to q4_0 while they load) never raises the process's resident memory by more than
1.1x the packed model plus the KV cache, at the load's peak. The load runs in a child process, after a small load
of the same kind (the code a load brings in is not the model's), and the peak is the kernel's own high-water mark
(VmHWM) reset just before it (clear_refs 5): the lifetime maximum (ru_maxrss) would include whatever came before."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from moedesk.kernels.quant_formats import quantize
from tests.load.test_gguf_checkpoint import spm_vocab

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's clear_refs")

CHILD = textwrap.dedent("""
    import json, re, sys, psutil, torch
    from moedesk.engine.runtime import Engine
    process = psutil.Process()
    options = dict(device="cpu", dtype="bfloat16", context_length=256, expert_dtype=sys.argv[3])
    Engine.load(sys.argv[2], **options)

    def high_water():
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\\s+(\\d+) kB", f.read()).group(1)) * 1024

    before = process.memory_info().rss
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from what is resident now
    engine = Engine.load(sys.argv[1], **options)
    peak, after = high_water(), process.memory_info().rss
    kv = engine.cache.bytes_per_position() * engine.cache.length * max(engine.cache.rows, 1)
    packed = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    packed += sum(moe.experts.nbytes for moe in engine.model.moe_blocks())
    formats = sorted({moe.experts.describe() for moe in engine.model.moe_blocks()})
    print(json.dumps({"before": before, "after": after, "peak": peak, "kv": kv, "packed": packed,
                      "formats": formats}))
""")


def measure(model, small, expert_dtype: str = "auto") -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(model), str(small), expert_dtype], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_q4_0_moe(path, H=1024, F=2816, E=8, L=8, heads=8, kv=2) -> None:
    """A Mixtral-style GGUF whose experts are q4_0 (~310 MB) and whose other weights are float16, small."""
    gen = torch.Generator().manual_seed(0)
    pieces, scores, types = spm_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L); w.add_context_length(256); w.add_embedding_length(H); w.add_feed_forward_length(F)
    w.add_head_count(heads); w.add_head_count_kv(kv); w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(H // heads); w.add_layer_norm_rms_eps(1e-5); w.add_expert_count(E)
    w.add_expert_used_count(2); w.add_vocab_size(len(pieces))
    w.add_tokenizer_model("llama"); w.add_token_list(pieces); w.add_token_scores(scores); w.add_token_types(types)
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)

    def f16(*shape):
        return (torch.randn(shape, generator=gen) * 0.02).half().numpy()

    def q4_0(*shape):
        return quantize(torch.randn(shape, generator=gen) * 0.02, "q4_0").numpy()

    hd = H // heads
    w.add_tensor("token_embd.weight", f16(len(pieces), H)); w.add_tensor("output.weight", f16(len(pieces), H))
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", f16(H, H)); w.add_tensor(p + "attn_k.weight", f16(kv * hd, H))
        w.add_tensor(p + "attn_v.weight", f16(kv * hd, H)); w.add_tensor(p + "attn_output.weight", f16(H, H))
        w.add_tensor(p + "ffn_gate_inp.weight", f16(E, H))
        for leaf, shape in (("gate", (E, F, H)), ("up", (E, F, H)), ("down", (E, H, F))):
            w.add_tensor(f"{p}ffn_{leaf}_exps.weight", q4_0(*shape), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_loading_a_4_bit_gguf_peaks_within_a_tenth_of_its_packed_size(tmp_path):
    path, small = tmp_path / "q4_0-moe.gguf", tmp_path / "small.gguf"
    write_q4_0_moe(path)
    write_q4_0_moe(small, H=256, F=256, E=2, L=1)
    size = path.stat().st_size
    m = measure(path, small)
    assert m["formats"] == ["q4_0"]
    grew, peak = m["after"] - m["before"], m["peak"] - m["before"]
    print(f"file {size / 2**20:.0f} MiB, packed {m['packed'] / 2**20:.0f} MiB: resident +{grew / 2**20:.0f} MiB "
          f"after load, peak +{peak / 2**20:.0f} MiB ({peak / m['packed']:.2f}x the packed model)")
    assert m["packed"] <= size
    assert peak <= 1.1 * m["packed"] + m["kv"]


def test_loading_a_split_gguf_peaks_within_a_tenth_of_its_packed_size(tmp_path):
    """The same model split in 3 parts (engine.load.gguf_split): each part is mapped as a single file is, and read
    with plain reads, so the parts add nothing to the peak."""
    from tests.gguf_split import split_gguf

    path, small = tmp_path / "q4_0-moe.gguf", tmp_path / "small.gguf"
    write_q4_0_moe(path)
    write_q4_0_moe(small, H=256, F=256, E=2, L=1)
    parts = split_gguf(path, tmp_path / "parts" / "q4_0-moe.gguf", 3)
    path.unlink()
    m = measure(parts[0], small)
    assert m["formats"] == ["q4_0"] and m["packed"] <= sum(p.stat().st_size for p in parts)
    assert m["peak"] - m["before"] <= 1.1 * m["packed"] + m["kv"]


def write_mixtral_safetensors(folder: Path, template: Path, H=512, F=1024, E=32, L=5, heads=8, kv=2) -> None:
    """A Mixtral checkpoint folder of bfloat16 tensors (the Hub's names, one tensor per expert; ~500 MB), beside
    the tiny transformers checkpoint's tokenizer. Many small experts: the load copies a few expert tensors at
    once, whose 16-bit source is what a load holds beyond the packed model."""
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(template / name, folder / name)
    config = json.loads((template / "config.json").read_text())
    config.update(hidden_size=H, intermediate_size=F, num_local_experts=E, num_hidden_layers=L,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=H // heads, torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    vocab, hd = config["vocab_size"], H // heads

    def w(*shape):
        return (torch.randn(shape, generator=gen) * 0.02).bfloat16()

    tensors = {"model.embed_tokens.weight": w(vocab, H), "lm_head.weight": w(vocab, H),
               "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    for i in range(L):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                        p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                        p + "self_attn.q_proj.weight": w(H, H), p + "self_attn.k_proj.weight": w(kv * hd, H),
                        p + "self_attn.v_proj.weight": w(kv * hd, H), p + "self_attn.o_proj.weight": w(H, H),
                        p + "block_sparse_moe.gate.weight": w(E, H)})
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            tensors.update({q + "w1.weight": w(F, H), q + "w3.weight": w(F, H), q + "w2.weight": w(H, F)})
    from safetensors.torch import save_file

    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_loading_16_bit_safetensors_as_int4_peaks_within_a_tenth_of_the_packed_size(tmp_path, tiny_checkpoint):
    template = tiny_checkpoint("mixtral")
    write_mixtral_safetensors(tmp_path / "big", template)
    write_mixtral_safetensors(tmp_path / "small", template, H=256, F=256, E=2, L=1)
    size = (tmp_path / "big" / "model.safetensors").stat().st_size
    m = measure(tmp_path / "big", tmp_path / "small", "int4")
    assert m["formats"] == ["q4_0"]
    peak = m["peak"] - m["before"]
    print(f"file {size / 2**20:.0f} MiB, packed {m['packed'] / 2**20:.0f} MiB: resident "
          f"+{(m['after'] - m['before']) / 2**20:.0f} MiB after load, peak +{peak / 2**20:.0f} MiB "
          f"({peak / m['packed']:.2f}x the packed model)")
    assert m["packed"] < size / 2
    assert peak <= 1.1 * m["packed"] + m["kv"]


def write_q4_k_mixtral(path: Path, dims: str, layers: int) -> None:
    """The writer of tests/perf/load_under_cgroup.sh's whole-model file (Q4_K experts, F16 rest), at a small shape."""
    import os

    script = Path(__file__).resolve().parents[1] / "perf" / "make_mixtral_q4k_gguf.py"
    done = subprocess.run([sys.executable, str(script), str(path), str(layers)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "MIXTRAL_DIMS": dims})
    assert done.returncode == 0, done.stderr[-2000:]


def test_loading_a_q4_k_gguf_as_the_box_writes_it_peaks_within_a_tenth_of_its_packed_size(tmp_path):
    """What a Q4_K_M file's experts are: the box's whole-model file at 8 layers of 1024 x 2816 (~310 MB)."""
    path, small = tmp_path / "q4_k-moe.gguf", tmp_path / "small.gguf"
    write_q4_k_mixtral(path, "1024,2816,8,2,8,2", 8)
    write_q4_k_mixtral(small, "256,256,2,2,4,2", 1)
    size = path.stat().st_size
    m = measure(path, small)
    assert m["formats"] == ["q4_k"]
    peak = m["peak"] - m["before"]
    print(f"file {size / 2**20:.0f} MiB, packed {m['packed'] / 2**20:.0f} MiB: peak +{peak / 2**20:.0f} MiB "
          f"({peak / m['packed']:.2f}x the packed model)")
    assert size > 250 * 2**20 and m["packed"] <= size
    assert peak <= 1.1 * m["packed"] + m["kv"]


def test_loading_16_bit_safetensors_as_stored_peaks_within_a_tenth_of_its_size(tmp_path, tiny_checkpoint):
    """Experts kept in the file's 16 bits: the packed model is the file, and the load holds little beyond it."""
    template = tiny_checkpoint("mixtral")
    write_mixtral_safetensors(tmp_path / "big", template)
    write_mixtral_safetensors(tmp_path / "small", template, H=256, F=256, E=2, L=1)
    size = (tmp_path / "big" / "model.safetensors").stat().st_size
    m = measure(tmp_path / "big", tmp_path / "small")
    assert m["formats"] == ["bfloat16"]
    peak = m["peak"] - m["before"]
    print(f"file {size / 2**20:.0f} MiB, packed {m['packed'] / 2**20:.0f} MiB: peak +{peak / 2**20:.0f} MiB "
          f"({peak / m['packed']:.2f}x the packed model)")
    assert m["packed"] >= 0.95 * size
    assert peak <= 1.1 * m["packed"] + m["kv"]


def write_fused_qwen35(folder: Path, template: Path, H=512, F=512, E=48, L=4) -> None:
    """A Qwen3.5-MoE checkpoint laid out as released (~300 MB of bfloat16): the multimodal config nesting the text
    model's, its tensors under model.language_model., each layer's experts fused into gate_up_proj [E, 2F, H] and
    down_proj [E, H, F] (transformers' own module layout, whose state dict gives every name and shape)."""
    import transformers
    from safetensors.torch import save_file

    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(template / name, folder / name)
    text = json.loads((template / "config.json").read_text())
    text.update(hidden_size=H, moe_intermediate_size=F, shared_expert_intermediate_size=F, num_experts=E,
                num_hidden_layers=L, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                                  for i in range(L)], dtype="bfloat16")
    with torch.device("meta"):
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, t in model.state_dict().items():
        value = torch.randn(t.shape, generator=gen) * 0.02 if t.dim() > 1 else torch.ones(t.shape)
        tensors[name.replace("model.", "model.language_model.", 1)] = value.bfloat16()
    assert tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * F, H)
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": {**text, "model_type": "qwen3_5_moe_text"}, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_loading_fused_qwen35_experts_peaks_within_a_tenth_of_the_model(tmp_path):
    """The released Qwen3.5-MoE keeps a layer's experts in two tensors: the loader reads them one expert (and one
    projection) at a time, so the peak stays within the issue-42 bound as for experts stored apart."""
    from tests.gguf_from_hf import build

    template = build("qwen35moe", tmp_path / "template").folder
    write_fused_qwen35(tmp_path / "big", template)
    write_fused_qwen35(tmp_path / "small", template, H=64, F=32, E=2)
    size = (tmp_path / "big" / "model.safetensors").stat().st_size
    m = measure(tmp_path / "big", tmp_path / "small")
    peak = m["peak"] - m["before"]
    print(f"file {size / 2**20:.0f} MiB, model {m['packed'] / 2**20:.0f} MiB: resident "
          f"+{(m['after'] - m['before']) / 2**20:.0f} MiB after load, peak +{peak / 2**20:.0f} MiB "
          f"({peak / m['packed']:.2f}x the model)")
    assert m["formats"] == ["bfloat16"] and m["packed"] >= 0.9 * size
    assert peak <= 1.1 * m["packed"] + m["kv"]


def write_qwen3_release(folder: Path, template: Path, quantization: dict, store, H, F, E, L, heads, kv, hd) -> None:
    """A Qwen3-MoE checkpoint as quantised releases lay it out (the Hub's names, one tensor per expert), with
    `quantization` as its config's quantization_config: every weight is drawn at random in bf16 and handed to
    `store(tensors, name, weight, expert)`, which puts it (or its quantised tensors) in `tensors`."""
    from safetensors.torch import save_file

    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(template / name, folder / name)
    config = json.loads((template / "config.json").read_text())
    config.update(hidden_size=H, moe_intermediate_size=F, num_experts=E, num_local_experts=E, num_hidden_layers=L,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, dtype="bfloat16",
                  quantization_config=quantization)
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    vocab, tensors = config["vocab_size"], {}

    def w(*shape):
        return (torch.randn(shape, generator=gen) * 0.02).bfloat16()

    tensors.update({"model.embed_tokens.weight": w(vocab, H), "lm_head.weight": w(vocab, H),
                    "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)})
    for i in range(L):
        p = f"model.layers.{i}."
        for norm, size in (("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.q_norm", hd),
                           ("self_attn.k_norm", hd)):
            tensors[f"{p}{norm}.weight"] = torch.ones(size, dtype=torch.bfloat16)
        tensors[p + "mlp.gate.weight"] = w(E, H)
        for proj, shape in (("q", (heads * hd, H)), ("k", (kv * hd, H)), ("v", (kv * hd, H)), ("o", (H, heads * hd))):
            store(tensors, f"{p}self_attn.{proj}_proj.weight", w(*shape), False)
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            for proj, shape in (("gate", (F, H)), ("up", (F, H)), ("down", (H, F))):
                store(tensors, f"{q}{proj}_proj.weight", w(*shape), True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_fp8_qwen3(folder: Path, template: Path, H=1056, F=352, E=40, L=6, heads=8, kv=2, hd=128) -> None:
    """A Qwen3-MoE checkpoint as the "-FP8" releases lay it out (~270 MB): every linear weight but the router's
    float8_e4m3fn in 128x128 blocks, with its float32 weight_scale_inv; the sizes end in partial blocks
    (1056 = 8 x 128 + 32, 352 = 2 x 128 + 96)."""
    from tests.load.test_fp8_blocks import to_fp8

    def store(tensors, name, weight, expert):
        tensors[name], tensors[name + "_scale_inv"] = to_fp8(weight, (128, 128))

    write_qwen3_release(folder, template, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]}, store, H, F, E, L, heads, kv, hd)


@pytest.mark.parametrize("expert_dtype, formats", [("auto", ["q8_0"]), ("bf16", ["bfloat16"])])
def test_loading_an_fp8_release_peaks_within_a_tenth_of_the_model(tmp_path, tiny_checkpoint, expert_dtype, formats):
    """Block-FP8 weights dequantised one tensor at a time: the peak stays within the issue-42 bound of the model as
    loaded, its experts in q8_0 (auto: about the file's size) or 16-bit (twice it)."""
    template = tiny_checkpoint("qwen3_moe")
    write_fp8_qwen3(tmp_path / "big", template)
    write_fp8_qwen3(tmp_path / "small", template, H=256, F=256, E=2, L=1)
    size = (tmp_path / "big" / "model.safetensors").stat().st_size
    m = measure(tmp_path / "big", tmp_path / "small", expert_dtype)
    peak = m["peak"] - m["before"]
    print(f"file {size / 2**20:.0f} MiB, model {m['packed'] / 2**20:.0f} MiB: resident "
          f"+{(m['after'] - m['before']) / 2**20:.0f} MiB after load, peak +{peak / 2**20:.0f} MiB "
          f"({peak / m['packed']:.2f}x the model)")
    assert m["formats"] == formats and size > 200 * 2**20
    assert peak <= 1.1 * m["packed"] + m["kv"]


def write_compressed_qwen3(folder: Path, template: Path, scheme: str, H=1024, F=512, E=32, L=8, heads=8, kv=2,
                           hd=128) -> None:
    """A Qwen3-MoE checkpoint in the compressed-tensors format as the releases lay it out: int4, Kimi-K2-Thinking's
    scheme (routed experts packed 8 to an int32, a bf16 scale per 32 weights, the rest bf16; ~270 MB), or fp8,
    GLM-4.5-FP8's (every projection float8_e4m3fn with a scale per output channel)."""
    from tests.load.test_compressed_tensors import (KIMI_IGNORE, ct_config, fp8_weights, int_weights, pack,
                                                    quantise_fp8, quantise_int)

    quantization = (ct_config(int_weights(4), "pack-quantized", KIMI_IGNORE) if scheme == "int4" else
                    ct_config(fp8_weights("channel"), "float-quantized", ["lm_head"] + [
                        f"model.layers.{i}.mlp.gate" for i in range(L)]))

    def store(tensors, name, weight, expert):
        module = name.removesuffix(".weight")
        if scheme == "int4" and expert:
            q, tensors[module + ".weight_scale"] = quantise_int(weight.float(), 4, 32)
            tensors[module + ".weight_packed"] = pack(q, 4)
            tensors[module + ".weight_shape"] = torch.tensor(list(weight.shape), dtype=torch.int32)
        elif scheme == "fp8":
            tensors[name], tensors[module + ".weight_scale"] = quantise_fp8(weight.float(), (1, None))
        else:
            tensors[name] = weight

    write_qwen3_release(folder, template, quantization, store, H, F, E, L, heads, kv, hd)


@pytest.mark.parametrize("scheme, experts, formats", [("int4", 32, ["q4_0"]), ("fp8", 16, ["q8_0"])])
def test_loading_a_compressed_tensors_release_peaks_within_a_tenth_of_the_model(tmp_path, tiny_checkpoint, scheme,
                                                                                 experts, formats):
    """compressed-tensors weights read one tensor at a time, under `auto`: INT4 experts kept packed as q4_0 (the
    file's size: 4 bits and a 16-bit scale per 32 weights either way), FP8 ones quantised to q8_0; the peak stays
    within the issue-42 bound of the model as loaded."""
    template = tiny_checkpoint("qwen3_moe")
    write_compressed_qwen3(tmp_path / "big", template, scheme, E=experts)
    write_compressed_qwen3(tmp_path / "small", template, scheme, H=256, F=256, E=2, L=1)
    size = (tmp_path / "big" / "model.safetensors").stat().st_size
    m = measure(tmp_path / "big", tmp_path / "small")
    peak = m["peak"] - m["before"]
    print(f"{scheme}: file {size / 2**20:.0f} MiB, model {m['packed'] / 2**20:.0f} MiB: resident "
          f"+{(m['after'] - m['before']) / 2**20:.0f} MiB after load, peak +{peak / 2**20:.0f} MiB "
          f"({peak / m['packed']:.2f}x the model)")
    assert m["formats"] == formats and size > 200 * 2**20
    assert peak <= 1.1 * m["packed"] + m["kv"]
    # The temporaries' pages go back to the system as the load goes (engine.load.loader.FreedMemory): what stays is
    # the model, not the allocator's arenas (which the CUDA build of torch left well above it: docs/measurements.md,
    # "Session 58").
    assert m["after"] - m["before"] <= 1.03 * m["packed"] + m["kv"]
