import importlib
import os
import shutil
import sys

import moedesk  # noqa: F401 -- first, as the CLI's import is: its C++ runtime preload precedes torch's
import pytest
import torch


def _hub_kernels_first() -> None:
    """Hugging Face's `kernels` package, where installed (transformers 5.25 requires it and imports it), loaded under
    its own name before anything asks for it: while tests run, this checkout's root is on sys.path, and its kernels/
    folder (moedesk.kernels) would be found first as a top-level `kernels`. Nothing of ours imports that name."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    try:
        importlib.import_module("kernels")
    except ImportError:  # not installed: transformers finds no `kernels` distribution and leaves the name alone
        pass
    finally:
        sys.path[:] = saved


_hub_kernels_first()

# Without a GPU, Triton kernels run in Triton's CPU interpreter (tests/kernels/test_gpu_fused_kernels.py).
# It must be chosen before Triton is first imported; the engine still uses them only for CUDA tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A test's threads must not depend on what else runs on the machine (a server the test started, CI's neighbours):
# the engines keep the threads their load chose. tests/generation/test_cpu_share.py turns the following on.
os.environ.setdefault("MOEDESK_FOLLOW_CPU", "0")

from tests import tiny_models  # noqa: E402  (after the interpreter is chosen)


def pytest_collection_modifyitems(config, items):
    # GPU tests run on the GPU box; elsewhere they skip with the reason in the report.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU box)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(arch) -> folder of a tiny transformers checkpoint, built once per session."""
    built = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = tiny_models.build(arch, tmp_path_factory.mktemp(arch))
        return built[arch]

    return get


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    """engines(arch, offload=False, device="cpu") -> a float32 engine of that tiny model (experts offloaded to the
    GPU tier, simulated on the CPU, at budget 0 when offload), loaded once per module."""
    from moedesk.engine.runtime import Engine

    made = {}

    def get(arch, offload=False, device="cpu"):
        if (arch, offload, device) not in made:
            kw = dict(offload=True, gpu_budget=0) if offload else {}
            made[arch, offload, device] = Engine.load(str(tiny_checkpoint(arch)), device=device, dtype="float32", **kw)
        return made[arch, offload, device]

    yield get
    for engine in made.values():
        engine.scheduler.close()  # what a failed test left in flight: no decode thread outlives the module


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Profiles, popularity counts and step timings of the tests' throwaway checkpoints are keyed by their paths:
    they go to this session's own cache folder, not the user's, which they used to fill with hundreds of files.
    The compiled native kernels and a built demo model are shared with the user's cache (minutes to rebuild)."""
    from moedesk.engine.load.demo import cache_root, recipe

    real, private = cache_root(), tmp_path_factory.mktemp("cache")
    (real / "kernels").mkdir(parents=True, exist_ok=True)
    (private / "kernels").symlink_to(real / "kernels", target_is_directory=True)
    r = recipe()
    demo = f"{r['name']}-v{r['version']}"
    if (real / demo / "config.json").is_file():
        (private / demo).symlink_to(real / demo, target_is_directory=True)
    before = os.environ.get("MOEDESK_CACHE_DIR")
    os.environ["MOEDESK_CACHE_DIR"] = str(private)
    yield private
    if before is None:
        os.environ.pop("MOEDESK_CACHE_DIR", None)
    else:
        os.environ["MOEDESK_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def llama_extra_buffers(_private_cache) -> bool:
    """Whether llama.cpp keeps its extra CPU weight buffers (AMX, repacked) on this machine, as the engine decides
    (engine.llamacpp.amx_probe); True without llama-cpp-python."""
    try:
        import llama_cpp
    except (ImportError, OSError):
        return True
    from moedesk.engine.llamacpp.amx_probe import extra_buffers_safe

    return extra_buffers_safe(_private_cache, getattr(llama_cpp, "__version__", "?"))


@pytest.fixture(scope="session", autouse=True)
def _llama_cpp_as_the_engine_runs_it(llama_extra_buffers):
    """Where llama.cpp's AMX kernels crash this machine the engine loads without its extra buffers; references built
    with llama-cpp-python's own Llama then load the same way, so that they neither end the run nor compute with
    other kernels than the engine's. A child process running llama-cpp-python does the same (LLAMA_OFF_CHILD)."""
    if llama_extra_buffers:
        yield
        return
    patched: dict = {}
    exec(LLAMA_OFF_CHILD, patched)
    yield
    patched["_api"].llama_model_default_params = patched["_default"]


# What a child process runs first, before its own llama-cpp-python code, where the engine turns the buffers off
# (and this process, by the fixture above).
LLAMA_OFF_CHILD = """
from llama_cpp import llama_cpp as _api
_default = _api.llama_model_default_params
def _without_extra_buffers():
    params = _default()
    params.use_extra_bufts = False
    return params
_api.llama_model_default_params = _without_extra_buffers
"""


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.stash[_PASSED] = report.passed
    return report


_PASSED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def _empty_tmp_path_once_passed(request):
    """A passed test's tmp_path is emptied as it ends: a run writes GBs of checkpoints (0.2-0.5 GB each), which
    filled CI's disk. The folder itself stays: pytest's own removal ("failed" retention) let the next test of the
    same name get the same path, and path-keyed caches (transformers models, profiles) then served it the last
    test's model."""
    path = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if path is not None and request.node.stash.get(_PASSED, False):
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _no_user_settings(tmp_path_factory, monkeypatch):
    # The CLI reads the app's saved settings; tests must never see the developer's own.
    monkeypatch.setenv("MOEDESK_CONFIG_DIR", str(tmp_path_factory.mktemp("config")))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of many small multi-token forwards: on two shared cores, OpenMP threads
    spinning against other processes made them up to ~100x slower. Use with pytest.mark.usefixtures."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
