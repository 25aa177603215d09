"""Expert banks in exact-size host arenas (engine.offload.pinned_memory), filled by the loader, then page-locked.

Without a GPU the locking is a fake registrar: it sees what cudaHostRegister would, in the same order (every
tensor of a layer written, then that layer locked; unlocked when its memory is freed), and can refuse. The
real registration, a non_blocking copy from it and the zero-copy kernel reading it run on the GPU box
(`pytest -m gpu`).
"""
import ctypes
import gc
import logging

import pytest
import torch

import moedesk.engine.runtime as runtime_module
from moedesk.engine.load.checkpoint import open_checkpoint
from moedesk.engine.load.loader import load_model
from moedesk.engine.offload.pinned_memory import PAGE, HostArena, HostBanks, PinError, arena_bytes, stack_shapes
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from moedesk.kernels.expert_weights import DENSE, ExpertWeights

GREEDY = SamplingParams(max_new_tokens=10, temperature=0)


class FakeRegistrar:
    """Records what it is asked to lock, with the bytes there at that moment; refuses from call `refuse_from` on."""

    def __init__(self, refuse_from: int | None = None):
        self.events, self.snapshots, self.refuse_from = [], {}, refuse_from

    def register(self, address: int, nbytes: int) -> None:
        if self.refuse_from is not None and len(self.snapshots) >= self.refuse_from:
            self.events.append(("refused", address))
            raise PinError("out of memory")
        self.events.append(("register", address))
        self.snapshots[address] = ctypes.string_at(address, nbytes)

    def unregister(self, address: int) -> None:
        self.events.append(("unregister", address))


def _load(folder, banks=None, threads=None):
    return load_model(open_checkpoint(str(folder)), torch.float32, torch.device("cpu"), 64, None, banks,
                      threads=threads)


def test_banks_take_exactly_the_experts_bytes():
    # A Mixtral-8x7B layer: torch's pinned allocator rounded its 1.88 GB gate/up stack up to 2 GiB.
    shapes = stack_shapes(8, 4096, 14336, torch.bfloat16, DENSE, DENSE)
    expert_bytes = 8 * 3 * 4096 * 14336 * 2
    assert arena_bytes(shapes) == expert_bytes
    arena = HostArena(arena_bytes(shapes))
    gate_up, down = (arena.take(shape, dtype) for shape, dtype in shapes)
    assert arena.nbytes == expert_bytes
    assert gate_up.untyped_storage().nbytes() + down.untyped_storage().nbytes() == expert_bytes
    assert down.data_ptr() == gate_up.data_ptr() + gate_up.nbytes  # one mapping, no gap
    with pytest.raises(ValueError):
        arena.take((1,), torch.uint8)

    # Packed rows need not fill whole pages: each stack still starts on one, at most a page apart.
    shapes = stack_shapes(3, 96, 64, torch.float32, "q4_0", "q8_0")
    exact = sum(torch.Size(s).numel() * d.itemsize for s, d in shapes)
    assert exact % PAGE and exact <= arena_bytes(shapes) < exact + 2 * PAGE


def test_loaded_banks_hold_exactly_the_experts_and_the_same_weights(tiny_checkpoint):
    folder = tiny_checkpoint("mixtral")
    plain, _, _ = _load(folder, threads=1)
    banks_of = HostBanks(torch.float32, pinned=False)
    model, _, banks = _load(folder, banks_of, threads=3)
    assert banks and banks_of.stats["pinned_bytes"] == 0
    for moe, ref in zip(model.moe_blocks(), plain.moe_blocks()):
        bank = banks[moe.layer]
        assert moe.experts is bank
        assert bank.gate_up.untyped_storage().nbytes() == bank.gate_up.numel() * 4
        assert bank.down.untyped_storage().nbytes() == bank.down.numel() * 4
        assert bank.nbytes <= banks_of.arenas[moe.layer].nbytes < bank.nbytes + 2 * PAGE
        assert torch.equal(bank.gate_up, ref.experts.gate_up) and torch.equal(bank.down, ref.experts.down)
    ours, theirs = dict(model.named_parameters()), dict(plain.named_parameters())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_each_layer_is_locked_once_filled_and_unlocked_when_freed(tiny_checkpoint):
    registrar = FakeRegistrar()
    banks_of = HostBanks(torch.float32, pinned=True, registrar=registrar)
    model, _, banks = _load(tiny_checkpoint("mixtral"), banks_of, threads=2)
    addresses = {layer: arena.address for layer, arena in banks_of.arenas.items()}
    assert registrar.events == [("register", addresses[layer]) for layer in sorted(banks)]
    for layer, bank in banks.items():
        arena = banks_of.arenas[layer]
        assert arena.pinned
        # Locked after the loader wrote the layer: what the registrar saw is the final bank.
        seen = registrar.snapshots[arena.address]
        assert seen[:bank.gate_up.nbytes] == bank.gate_up.numpy().tobytes()
        start = bank.down.data_ptr() - arena.address
        assert seen[start:start + bank.down.nbytes] == bank.down.numpy().tobytes()
    assert banks_of.stats["pinned_bytes"] == sum(a.nbytes for a in banks_of.arenas.values())
    assert banks_of.warnings == []

    # A bank's views outlive the arena object: the lock goes only with the last of them.
    view = banks[0].expert(1)
    del model, banks, banks_of, bank, arena
    gc.collect()
    unlocked = [a for kind, a in registrar.events if kind == "unregister"]
    assert sorted(unlocked) == sorted(a for layer, a in addresses.items() if layer != 0)
    del view
    gc.collect()
    assert sorted(a for kind, a in registrar.events if kind == "unregister") == sorted(addresses.values())


def test_a_refused_lock_leaves_the_rest_pageable_with_one_warning(tiny_checkpoint, monkeypatch, caplog):
    folder = str(tiny_checkpoint("mixtral"))
    registrar = FakeRegistrar(refuse_from=1)
    made = []

    def allocator(dtype, pinned, warnings):
        made.append(HostBanks(dtype, True, warnings, registrar=registrar))
        return made[-1]

    monkeypatch.setattr(runtime_module, "host_bank_allocator", allocator)
    with caplog.at_level(logging.WARNING, logger="moedesk"):
        locked = Engine.load(folder, device="cpu", dtype="float32", offload=True, gpu_budget=0)
    banks_of = made[0]
    layers = sorted(banks_of.arenas)
    assert len(layers) > 2
    # The first layer stays locked; the second is refused, and after a refusal nothing more is asked.
    assert [kind for kind, _ in registrar.events] == ["register", "refused"]
    assert [banks_of.arenas[layer].pinned for layer in layers] == [True] + [False] * (len(layers) - 1)
    left = sum(banks_of.arenas[layer].nbytes for layer in layers[1:]) / 2**30
    total = sum(a.nbytes for a in banks_of.arenas.values()) / 2**30
    [line] = locked.warnings
    assert line == (f"could not pin {left:.1f} of {total:.1f} GiB of experts in RAM (out of memory); "
                    f"copies of those to the GPU will be slower")
    assert [r.getMessage() for r in caplog.records if r.name == "moedesk"] == [line]

    # Locked or not, the same tokens as a model loaded without banks.
    plain = Engine.load(folder, device="cpu", dtype="float32", offload=False)
    prompts = [locked.tokenizer.encode(p) for p in ("Hi", "The quick brown fox")]
    tokens = {}
    for name, loaded in (("locked", locked), ("plain", plain)):
        done = {c.tag: c.token_ids for c in loaded.generate([Request(p, GREEDY, tag=i) for i, p in
                                                            enumerate(prompts)], 2)}
        tokens[name] = [done[i] for i in range(len(prompts))]
    assert tokens["locked"] == tokens["plain"]


def test_each_shard_is_unmapped_once_its_tensors_are_read(tiny_checkpoint, tmp_path, monkeypatch):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    # The tiny model in three shards: layer 0's tensors, layer 1's, and everything else (read first).
    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("mixtral"), folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = {}
    for file in tiny_checkpoint("mixtral").glob("*.safetensors"):
        tensors.update(load_file(str(file)))

    def shard_of(name):
        return 1 if ".layers.0." in name else 2 if ".layers.1." in name else 3

    weight_map = {n: f"model-{shard_of(n):05d}-of-00003.safetensors" for n in tensors}
    for shard in set(weight_map.values()):
        save_file({n: t for n, t in tensors.items() if weight_map[n] == shard}, str(folder / shard),
                  metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    for threads in (1, 3):
        checkpoint = open_checkpoint(str(folder))
        released = []  # (name, shards still mapped after it)
        release = checkpoint.release

        def spy(name, checkpoint=checkpoint, release=release, released=released):
            release(name)
            with checkpoint._opening:
                released.append((name, {f.name for f in checkpoint._open}))

        monkeypatch.setattr(checkpoint, "release", spy)
        load_model(checkpoint, torch.float32, torch.device("cpu"), 64, None, HostBanks(torch.float32, pinned=False),
                   threads=threads)
        assert sorted(n for n, _ in released) == sorted(tensors)  # every tensor released once
        assert checkpoint._open == {}
        if threads == 1:  # (with more, the order tensors finish in is the threads')
            last_of_layer_0 = max(i for i, (n, _) in enumerate(released) if ".layers.0." in n)
            # Layer 0's shard went with its last tensor, while layer 1's experts were still to be read.
            assert "model-00001-of-00003.safetensors" not in released[last_of_layer_0][1]
            assert any(".layers.1." in n and ".experts." in n for n, _ in released[last_of_layer_0 + 1:])


def test_a_failed_load_drops_the_locks_not_yet_begun(tiny_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from moedesk.engine.errors import CheckpointError

    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("mixtral"), folder)
    # One expert tensor of the last layer has a wrong shape: the loader stops there, so that layer is never whole.
    for file in folder.glob("*.safetensors"):
        tensors = load_file(str(file))
        downs = [k for k in tensors if ".experts." in k and k.endswith("w2.weight")]
        if downs:
            bad = max(downs, key=lambda k: int(k.split(".layers.")[1].split(".")[0]))
            tensors[bad] = tensors[bad][:, :-1].contiguous()
            save_file(tensors, str(file), metadata={"format": "pt"})
    bad_layer = int(bad.split(".layers.")[1].split(".")[0])
    registrar = FakeRegistrar()
    banks_of = HostBanks(torch.float32, pinned=True, registrar=registrar)
    with pytest.raises(CheckpointError, match="shape"):
        _load(folder, banks_of, threads=2)
    assert banks_of.warnings == []
    locked = [a for kind, a in registrar.events if kind == "register"]
    assert banks_of.arenas[bad_layer].address not in locked
    assert all(banks_of.arenas[layer].pinned == (banks_of.arenas[layer].address in locked) for layer in banks_of.arenas)
    banks_of.arenas.clear()
    gc.collect()  # the half-loaded model is gone: whatever was locked is unlocked
    assert sorted(a for kind, a in registrar.events if kind == "unregister") == sorted(locked)


@pytest.mark.gpu
def test_registered_banks_copy_asynchronously_and_serve_the_zero_copy_kernel():
    from moedesk.engine.offload.pinned_memory import CudaRegistrar
    from moedesk.kernels import gpu_fused, gpu_zero_copy
    from moedesk.kernels.cpu_experts import expert_forward

    device = torch.device("cuda")
    E, H, F = 4, 256, 512
    shapes = stack_shapes(E, H, F, torch.bfloat16, DENSE, DENSE)
    arena = HostArena(arena_bytes(shapes))
    gate_up, down = (arena.take(shape, dtype) for shape, dtype in shapes)
    gen = torch.Generator().manual_seed(0)
    gate_up.copy_(torch.randn(gate_up.shape, generator=gen) * 0.05)
    down.copy_(torch.randn(down.shape, generator=gen) * 0.05)
    assert not gate_up.is_pinned()
    arena.register(CudaRegistrar())
    assert arena.pinned and gate_up.is_pinned() and down.is_pinned()

    staging = torch.empty_like(gate_up, device=device)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the copy queues behind this, so a synchronous copy would wait for it here
    started = torch.cuda.Event(enable_timing=True)
    started.record()
    staging.copy_(gate_up, non_blocking=True)
    assert not started.query(), "the non_blocking copy from registered memory waited for the stream"
    torch.cuda.synchronize()
    assert torch.equal(staging.cpu(), gate_up)

    bank = ExpertWeights(gate_up, down, H, F)
    if gpu_fused.wanted():  # zero-copy: the kernel reads the registered pages through their host address (UVA)
        assert gpu_zero_copy.applies(device, bank)
        x = (torch.randn(2, H, generator=gen) * 0.5).to(torch.bfloat16).to(device)
        ids = torch.tensor([[1, 3], [2, 0]], device=device)
        out = torch.empty(4, H, dtype=torch.bfloat16, device=device)
        gpu_zero_copy.zero_copy_experts(x, ids, 0, bank, out)
        for t in range(2):
            for r in range(2):
                e = ids[t, r].item()
                ref = expert_forward(x[t:t + 1], gate_up[e].to(device), down[e].to(device))
                torch.testing.assert_close(out[t * 2 + r:t * 2 + r + 1], ref, rtol=2e-2, atol=2e-3)
    del gate_up, down, staging, arena, bank
    gc.collect()  # unregisters; a failure there would surface at the next CUDA call
    torch.cuda.synchronize()


def test_a_pinned_copy_takes_an_exact_arena_locked_at_once():
    registrar = FakeRegistrar()
    banks_of = HostBanks(torch.bfloat16, pinned=True, registrar=registrar)
    table = torch.randn(1000, 72).to(torch.bfloat16)
    copy = banks_of.pinned_copy(table)
    assert torch.equal(copy, table) and copy.data_ptr() != table.data_ptr()
    assert registrar.events == [("register", copy.data_ptr())]
    assert registrar.snapshots[copy.data_ptr()][:table.nbytes] == table.view(torch.uint8).numpy().tobytes()
    assert banks_of.stats["pinned_bytes"] == -(-table.nbytes // PAGE) * PAGE  # its size, not a power of two
    assert HostBanks(torch.bfloat16, pinned=True, registrar=FakeRegistrar(refuse_from=0)).pinned_copy(table) is None
    assert HostBanks(torch.bfloat16, pinned=False).pinned_copy(table) is None


def test_the_loader_puts_the_token_table_in_a_pinned_copy_where_it_stays_in_host(tiny_checkpoint, monkeypatch):
    from moedesk.engine.load import loader

    monkeypatch.setattr(loader, "table_in_host", lambda cfg, device: True)  # as beside a GPU
    registrar = FakeRegistrar()
    model, _, _ = _load(tiny_checkpoint("mixtral"), HostBanks(torch.float32, pinned=True, registrar=registrar))
    plain, _, _ = _load(tiny_checkpoint("mixtral"))
    assert ("register", model.embed.weight.data_ptr()) in registrar.events
    assert torch.equal(model.embed.weight, plain.embed.weight)
