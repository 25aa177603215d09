"""The automatic batch size over several GPUs (issue 45): each GPU holds its own layers' KV cache, so the batch is the
least over the devices of (its free memory / its layers' cache a sequence), not GPU 0's room against every layer's."""
import torch

import moedesk.app.batch as batch_module
from moedesk.app.batch import batch_size_for_devices, batch_size_for_memory, kv_bytes_by_device

MIB, GIB = 2**20, 2**30


def test_the_least_device_sets_the_batch():
    # GPU 0: 20 GiB free, 1 GiB a sequence -> 10 at half; GPU 1: 3 GiB free, 0.5 GiB a sequence -> 3.
    assert batch_size_for_devices([(20 * GIB, GIB), (3 * GIB, GIB // 2)]) == 3
    assert batch_size_for_devices([(20 * GIB, GIB)]) == batch_size_for_memory(20 * GIB, GIB) == 10
    assert batch_size_for_devices([(GIB, 4 * GIB), (GIB, 4 * GIB)]) == 1  # never below one
    assert batch_size_for_devices([(2**40, MIB), (2**40, 0)]) == batch_size_for_memory(2**40, MIB)  # the cap


class Kind:
    def __init__(self, device, per_position):
        self.device, self.per_position = torch.device(device), per_position

    def bytes_per_position(self):
        return self.per_position


class Spread:
    """A cache as a spread model makes it: one kind per run of layers, each on its own device."""

    def __init__(self, *kinds):
        self.kinds = list(kinds)
        self.device = self.kinds[0].device

    def bytes_per_position(self):
        return sum(k.bytes_per_position() for k in self.kinds)


class Engine:
    context_length = 4096

    def __init__(self, cache, device="cuda:0"):
        self.cache, self.device = cache, torch.device(device)


def test_each_gpu_is_asked_for_its_own_room_against_its_own_layers(monkeypatch):
    free = {torch.device("cuda:0"): 20 * GIB, torch.device("cuda:1"): 3 * GIB}
    monkeypatch.setattr(batch_module, "free_memory_bytes", lambda device: free[torch.device(device)])
    engine = Engine(Spread(Kind("cuda:0", MIB), Kind("cuda:1", MIB // 2)))
    # GPU 0's room against every layer's cache (what was read) gives 6; GPU 1 holds 3 of its half.
    assert batch_size_for_memory(free[engine.device], engine.cache.bytes_per_position() * 1024) == 6
    assert batch_module.auto_batch_size(engine, 1024) == 3


def test_one_device_is_asked_as_before(monkeypatch):
    asked = []
    monkeypatch.setattr(batch_module, "free_memory_bytes", lambda device: asked.append(device) or 20 * GIB)
    # gpt-oss's kinds (sliding and full) on one GPU, a plain cache, and a cache that names no device (llama.cpp's)
    one_gpu = Spread(Kind("cuda", MIB), Kind("cuda", MIB // 2))
    plain = Kind("cuda", 3 * MIB // 2)

    class Unplaced:
        def bytes_per_position(self):
            return 3 * MIB // 2

    for cache in (one_gpu, plain, Unplaced()):
        asked.clear()
        assert batch_module.auto_batch_size(Engine(cache, "cuda"), 1024) == 6
        assert asked == [torch.device("cuda")]  # the engine's device, once


def test_a_spread_models_cache_is_counted_on_each_device():
    # A real spread cache: layer 0 on the CPU, layers 1-3 on "meta" (which allocates nothing) for a second device.
    from moedesk.engine.load.synthetic import SHAPES, synthetic_model
    from moedesk.engine.model.layer_devices import spread_model

    model = synthetic_model(SHAPES["tiny-moe"], torch.float32, "cpu", pinned=False, context=64)[0]
    whole = model.new_cache(1, 8, torch.float32, "cpu").bytes_per_position()
    spread_model(model, ["cpu", "meta"], (0, 1, 1, 1))
    found = kv_bytes_by_device(model.new_cache(1, 8, torch.float32, "cpu"))
    assert found == {torch.device("cpu"): whole // 4, torch.device("meta"): 3 * whole // 4}
    # the simulated two devices ("cpu", "cpu") are one memory: one figure, the whole cache's
    same = synthetic_model(SHAPES["tiny-moe"], torch.float32, "cpu", pinned=False, context=64)[0]
    spread_model(same, ["cpu", "cpu"], (0, 1, 1, 1))
    assert kv_bytes_by_device(same.new_cache(1, 8, torch.float32, "cpu")) == {torch.device("cpu"): whole}
