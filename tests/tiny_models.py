"""Tiny random-initialised checkpoints of every supported architecture, written by transformers.

transformers is the reference nobody here wrote: these folders are what save_pretrained
produces, with a small byte-level BPE tokenizer and a ChatML template beside them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A template in Qwen3's manner for tests of tools and reasoning: it lists the tools in the system turn, writes
# past tool calls as <tool_call> JSON and tool results as <tool_response>, and opens a <think> block for the reply
# unless enable_thinking is false (then it writes an empty one, as Qwen3's does).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == 'system' else '' }}"
    "\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Call a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif message['role'] != 'system' %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}\n<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 384
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Mixture of experts models route every token to a few experts out of many.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Experts live in RAM; the most popular ones live on the GPU.",
    "Hello, world! How are you today? 1234567890 + - * / = ( ) [ ] { }",
]

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.08,
              tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=48)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "smollm": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_theta=100000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                             intermediate_size=48, rope_theta=1e6)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(MOE, num_experts=6, shared_expert_intermediate_size=80,
                                                                mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(MOE, num_experts=8, norm_topk_prob=True, head_dim=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(MOE, num_experts=8, norm_topk_prob=False)),
    # Group-limited sigmoid routing (2 groups of 4, the best one kept), a dense first layer, partial RoPE, q/k
    # norms and biases: every switch GLM-4.x has.
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(MOE, n_routed_experts=8, n_group=2, topk_group=1,
                                                            n_shared_experts=1, first_k_dense_replace=1,
                                                            routed_scaling_factor=2.5, use_qk_norm=True,
                                                            attention_bias=True, partial_rotary_factor=0.5)),
    # Sinks, biases, yarn, a window of 8 on every other layer (prompts run past it), MXFP4-free experts (their
    # packed form is tests/model/test_families.py's).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                                         sliding_window=8, intermediate_size=64,
                                                         layer_types=["sliding_attention", "full_attention",
                                                                      "sliding_attention"])),
    # MLA (a query bottleneck, values narrower than keys, interleaved RoPE, yarn with its softmax scale) and the
    # routing GLM-4.x shares: 4 groups of 2, the best 2 kept.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        MOE, n_routed_experts=8, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, num_key_value_heads=4, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # GLM-4.7-Flash's MLA (the DeepSeek-V3 form, plain RoPE) with its dense layers named in mlp_layer_types.
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        MOE, n_routed_experts=8, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.8,
        q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        num_key_value_heads=4, mlp_layer_types=["dense", "sparse", "sparse"])),
    # MiniMax-M2: q/k norms over all heads at once, half of each head rotated, sigmoid routing with a correction bias
    # and no groups. The half is said twice, as transformers writes it since its fix for huggingface/transformers#48241:
    # before it (the GPU box's 5.17) a rotary_dim alone, as released configs say it, was ignored and the whole head
    # turned, which the released weights were not trained with.
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, head_dim=16, intermediate_size=48, rotary_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5})),
}
# Parameters the reference initialises to zeros (or ones) that would leave a switch untested: drawn at random.
RANDOMISED = {"glm4_moe": ("e_score_correction_bias",), "deepseek_v3": ("e_score_correction_bias",),
              "glm4_moe_lite": ("e_score_correction_bias",), "gpt_oss": ("sinks", "bias"),
              "minimax_m2": ("e_score_correction_bias",)}


def train_tokenizer(special_tokens: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL + list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def build(arch: str, folder: Path, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE,
          special_tokens: tuple[str, ...] = (), eos_token: str = "<|im_end|>", stored: torch.dtype | None = None,
          **config) -> Path:
    """Write a tiny checkpoint of `arch` (a key of ARCHS) into folder and return it (config: fields to change;
    chat_template None: none written; special_tokens: the tokenizer's own after SPECIAL's, ids 3, 4, ...; stored:
    the weights' dtype in the files, as released models store bfloat16; default float32)."""
    import transformers

    config_name, model_name, extra = ARCHS[arch]
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(RANDOMISED.get(arch, ())):
                tensor.copy_(torch.randn_like(tensor) * 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    (model if stored is None else model.to(stored)).save_pretrained(folder)
    tok = train_tokenizer(special_tokens)
    tok.save(str(folder / "tokenizer.json"))
    tokenizer_config = {"bos_token": "<|endoftext|>", "eos_token": eos_token}
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


def budget_for_experts(folder, count: int, device: str = "cpu", dtype: str = "float32") -> float:
    """The --gpu-budget (GiB) that keeps `count` experts of the model at `folder` resident beside what the budget
    holds first (its weights, the cache of its whole context, workspace): a probe loaded with every expert in RAM
    says (Engine.gpu_budget_for_experts)."""
    from moedesk.engine.runtime import Engine

    probe = Engine.load(str(folder), device=device, dtype=dtype, offload=True, gpu_budget=0)
    return probe.gpu_budget_for_experts(count)
