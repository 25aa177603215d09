"""The references: Hugging Face transformers' greedy tokens and logits for a checkpoint folder, llama.cpp's
(llama-cpp-python) greedy tokens for a GGUF file."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def hf_model(folder, dtype=torch.float32, device="cpu", gguf_file=None):
    import transformers

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kwargs).to(device).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    """Greedy continuation without the end-of-sequence token (moedesk's token_ids leave it out)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=list(eos_ids) or None, pad_token_id=0)
    new = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(new):
        if t in eos_ids:
            return new[:i]
    return new


def hf_last_logits(model, prompt_ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([prompt_ids], device=device)).logits[0, -1].float().cpu()


def llama_greedy(llm, prompt_ids: list[int], n: int, stop=()) -> list[int]:
    """llama-cpp-python's greedy continuation of up to n tokens, cut before the first token in `stop`."""
    out = []
    for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        if int(token) in stop:
            break
        out.append(int(token))
        if len(out) == n:
            break
    return out
