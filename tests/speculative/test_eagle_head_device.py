"""An EAGLE-1/2 head shares the target's LM head where it lives (issue 45, item 2): on a spread that is the last
layer's GPU, where the per-device plan counts it; a copy on the engine's device (GPU 0) was memory no plan holds."""
import types

import pytest
import torch

from moedesk.engine.speculative.eagle import EagleConfig, EagleHead, save_eagle_head
from moedesk.engine.speculative.eagle_drafter import draft_head

VOCAB = 50
EAGLE1 = EagleConfig(version=1, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                     rms_norm_eps=1e-6, vocab_size=VOCAB, draft_vocab_size=VOCAB, target_hidden_size=64)


def engine_with_head_on(tmp_path, head_device: str):
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(VOCAB, 64, generator=g)
    save_eagle_head(EagleHead(EAGLE1, embed=embed), tmp_path, with_embedding=False)
    lm_head = torch.randn(VOCAB, 64, generator=g).to(head_device)
    model = types.SimpleNamespace(embed=torch.nn.Embedding.from_pretrained(embed),
                                  lm_head=types.SimpleNamespace(weight=torch.nn.Parameter(lm_head, requires_grad=False)))
    return types.SimpleNamespace(model=model, draft_heads={}, dtype=torch.float32, device=torch.device("cpu"),
                                 config=types.SimpleNamespace(vocab_size=VOCAB))


def test_the_head_is_shared_where_it_lives_not_copied_to_the_engines_device(tmp_path):
    # "meta" stands for the last GPU: a copy to the engine's device (the CPU here) cannot be made of it at all.
    engine = engine_with_head_on(tmp_path, "meta")
    head = draft_head(engine, tmp_path)
    assert head.target_lm_head.device.type == "meta" and head.fc.weight.device.type == "cpu"


def test_on_one_device_the_head_is_the_targets_tensor(tmp_path):
    engine = engine_with_head_on(tmp_path, "cpu")
    head = draft_head(engine, tmp_path)
    assert head.target_lm_head.data_ptr() == engine.model.lm_head.weight.data_ptr()
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(head.logits(hidden), hidden @ engine.model.lm_head.weight.T)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_logits_from_a_head_on_another_gpu_come_back_to_the_heads_device(tmp_path):
    engine = engine_with_head_on(tmp_path, "cuda:1")
    engine.device = torch.device("cuda:0")
    head = draft_head(engine, tmp_path)
    hidden = torch.randn(3, 64, device="cuda:0")
    logits = head.logits(hidden)
    assert logits.device == hidden.device
    torch.testing.assert_close(logits, hidden @ engine.model.lm_head.weight.to("cuda:0").T)
