"""Issue 45's device choices, decided on the CPU: the default dtype asks every GPU the model runs on (items 4), and a
thread running one GPU named cuda:N makes it current (item 5), a no-op on plain "cuda" and on the CPU."""
import threading

import pytest
import torch

import moedesk.engine.hardware as hardware
import moedesk.engine.load.loader as loader
from moedesk.engine.hardware import thread_gpu, use_device
from moedesk.engine.load.loader import default_dtype, resolve_dtype


def test_bf16_only_where_every_gpu_has_it():
    assert default_dtype("cuda", [True]) is torch.bfloat16
    assert default_dtype("cuda", [True, True]) is torch.bfloat16
    assert default_dtype("cuda", [True, False]) is torch.float16  # a pre-Ampere second card
    assert default_dtype("cuda", [False]) is torch.float16
    assert default_dtype("cpu", []) is torch.float32


def test_resolve_dtype_asks_each_gpu_of_a_spread(monkeypatch):
    asked = []
    monkeypatch.setattr(loader, "_bf16_supported", lambda device: asked.append(device) or device.index != 1)
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert resolve_dtype(None, gpus[0], gpus) is torch.float16 and asked == gpus
    asked.clear()
    assert resolve_dtype(None, torch.device("cuda")) is torch.bfloat16 and asked == [torch.device("cuda")]
    asked.clear()
    assert resolve_dtype(None, torch.device("cuda", 1)) is torch.float16  # one GPU named cuda:1: its own support
    assert resolve_dtype("bfloat16", gpus[0], gpus) is torch.bfloat16  # named: as named
    assert resolve_dtype(None, torch.device("cpu"), ["cpu", "cpu"]) is torch.float32 and asked == [gpus[1]]


def test_the_thread_gpu_is_set_only_for_an_indexed_cuda_device():
    assert thread_gpu("cuda:1") == 1 and thread_gpu(torch.device("cuda", 0)) == 0
    assert thread_gpu("cuda") is None and thread_gpu("cpu") is None


def test_use_device_sets_a_new_threads_gpu_and_leaves_the_rest(monkeypatch):
    current, sets = {"gpu": 0}, []
    monkeypatch.setattr(hardware.torch.cuda, "current_device", lambda: current["gpu"])
    monkeypatch.setattr(hardware.torch.cuda, "set_device", lambda i: sets.append(i))
    for device in ("cpu", "cuda", "cuda:0", torch.device("cpu")):
        use_device(device)
    assert sets == []  # nothing on the CPU, plain "cuda", or the GPU already current
    use_device("cuda:1")
    assert sets == [1]


def test_the_load_makes_its_device_current_before_the_model_runs(monkeypatch):
    # The loading thread profiles, calibrates and warms up: it runs on the device it loads for.
    from moedesk.engine import runtime

    seen = []
    monkeypatch.setattr(runtime, "use_device", lambda device: seen.append(torch.device(device)))
    runtime.Engine.load("demo", device="cpu", offload=False)
    assert seen == [torch.device("cpu")]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_one_gpu_named_cuda_1_decodes_on_it():
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine

    def run(device):
        engine = Engine.load("demo", device=device)
        return engine.complete([Request([1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0))])[0].token_ids

    result = {}
    worker = threading.Thread(target=lambda: result.update(ids=run("cuda:1")))  # a fresh thread starts on GPU 0
    worker.start()
    worker.join()
    assert result["ids"] == run("cuda:0")


def test_the_step_times_are_measured_on_the_engines_device(monkeypatch, tmp_path):
    # The chat app measures auto's step times on a worker thread of its own: under on_device, not GPU 0.
    import contextlib
    import types

    from moedesk.engine.speculative import step_times

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    inside = []

    @contextlib.contextmanager
    def on(device):
        inside.append(device)
        yield
        inside.append(None)

    monkeypatch.setattr(hardware, "on_device", on)
    monkeypatch.setattr(step_times, "measure_step_times", lambda *a, **k: inside.append("measure") or {"1,1": 1.0})
    engine = types.SimpleNamespace(orchestra=None, graphs=None, name="m", device=torch.device("cuda", 1),
                                   dtype=torch.bfloat16, model=None, executor=None, config=None)
    step_times.engine_step_times(engine, 1, 0)
    assert inside == [torch.device("cuda", 1), "measure", None]
