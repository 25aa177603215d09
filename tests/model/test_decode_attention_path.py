"""The model's decode step through the split-key attention kernel (kernels.gpu_decode_attention, which the model
takes for 16-bit CUDA tensors): run here in Triton's interpreter on the CPU, its logits are the SDPA path's, for
rows picked out of order and of different lengths."""
import torch

from moedesk.engine.load.synthetic import shape_config, synthetic_model
from moedesk.engine.offload.expert_executor import LocalExecutor
from moedesk.kernels import gpu_decode_attention


def test_decode_through_the_kernel_gives_the_sdpa_logits(monkeypatch):
    cfg = shape_config("tiny-moe", 2)
    model, _ = synthetic_model(cfg, torch.float32, "cpu", pinned=False, context=128)
    executor = LocalExecutor()
    gen = torch.Generator().manual_seed(0)
    prompts = {2: torch.randint(3, cfg.vocab_size, (1, 40), generator=gen),
               0: torch.randint(3, cfg.vocab_size, (1, 9), generator=gen)}
    step = torch.randint(3, cfg.vocab_size, (2, 1), generator=gen)

    def decode():
        cache = model.new_cache(3, 128, torch.float32, "cpu")
        for row, tokens in prompts.items():
            model(tokens, torch.arange(tokens.shape[1])[None], cache, executor, rows=torch.tensor([row]))
        positions = torch.tensor([[40], [9]])
        return model(step, positions, cache, executor, rows=torch.tensor([2, 0]))

    expected = decode()
    calls = []
    real = gpu_decode_attention.decode_attention
    monkeypatch.setattr(gpu_decode_attention, "applies", lambda q, cache_k: True)
    monkeypatch.setattr(gpu_decode_attention, "decode_attention", lambda *a: calls.append(1) or real(*a))
    got = decode()
    assert len(calls) == cfg.num_layers  # every layer's decode went through the kernel
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
