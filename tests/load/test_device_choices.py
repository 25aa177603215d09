"""Issue 45's device choices, decided on the CPU: the default dtype asks every GPU the model runs on (items 4), and a
thread running one GPU named cuda:N makes it current (item 5), a no-op on plain "cuda" and on the CPU. The chat
app's dtype preview asks the load's own function."""
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
def test_one_gpu_named_cuda_1_decodes_on_it(tmp_path, monkeypatch):
    # A tiny Mixtral, not the demo: the GPU box lacks the demo's source package.
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine
    from tests.tiny_models import build

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "cache"))
    model = str(build("mixtral", tmp_path / "mixtral", num_hidden_layers=2))

    def run(device):
        engine = Engine.load(model, device=device)
        return engine.complete([Request([1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0))])[0].token_ids

    result = {}

    def work():  # a fresh thread starts on GPU 0
        try:
            result["ids"] = run("cuda:1")
        except Exception as error:  # shown by the assert below, not lost in the thread
            result["error"] = error

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert "error" not in result, result.get("error")
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


class Stop(Exception):
    pass


@pytest.fixture
def gpu_1_without_bf16(monkeypatch):
    """Two GPUs as torch.cuda's capability calls see them: GPU 0 has bf16, GPU 1 (a pre-Ampere card) has not."""
    current = {"gpu": 0}

    class device:  # torch.cuda.device: the GPU the block's questions are asked of
        def __init__(self, d):
            self.index = torch.device(d).index

        def __enter__(self):
            self.before = current["gpu"]
            if self.index is not None:
                current["gpu"] = self.index

        def __exit__(self, *exc):
            current["gpu"] = self.before

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: current["gpu"] != 1)


@pytest.mark.parametrize("device, budget, expected", [("cuda:1", None, "float16"), ("cuda:0", None, "bfloat16"),
                                                      ("auto", None, "bfloat16"), ("auto", (8, 8), "float16")])
def test_the_chat_apps_dtype_preview_is_the_loads_choice(gpu_1_without_bf16, monkeypatch, device, budget, expected):
    # The Models screen's dtype is what the native load will pick: for a named cuda:1 that GPU's support, for a
    # spread every GPU's, not the current GPU's alone
    from moedesk.app.tui import MoedeskApp
    from moedesk.app.tui.load_target import load_target
    from moedesk.app.tui.settings import Settings
    from moedesk.engine import runtime

    app = MoedeskApp(settings=Settings(), device=device, gpu_budget=list(budget) if budget else None)
    shown = load_target(app).weights_dtype
    chosen = []

    def resolve(*args):
        chosen.append(str(resolve_dtype(*args)).removeprefix("torch."))
        raise Stop  # the choice is made: nothing of the load needs a GPU past it

    monkeypatch.setattr(runtime, "resolve_dtype", resolve)
    with pytest.raises(Stop):
        app.engine_factory("demo", None)
    assert shown == chosen[0] == expected
