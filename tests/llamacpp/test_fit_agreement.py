"""The Models screen's fit line and the llama.cpp engine's load agree (issues 40 and 42). For tiny GGUFs written here
and fake machines (the RAM psutil sees, a cgroup's memory.max, a GPU llama.cpp offloads to and its free memory, a
--gpu-budget), the line the screen shows, read from its exported screenshot as a person reads it, says the model
fits exactly when the load goes on to llama.cpp, in the figures the load planned, and that it does not fit exactly
when the load refuses it, in the load's own words. Among them a GGUF that fits only because its experts go to the
GPU, and a split one that fits only at a shorter context, which then loads."""
from __future__ import annotations

import re
import shutil

import pytest
from gguf import GGUFReader

import moedesk.engine.llamacpp.fit as fit
from moedesk.app.tui import MoedeskApp
from moedesk.engine.errors import MoedeskError
from moedesk.engine.load.gguf_split import open_gguf
from moedesk.engine.runtime import Engine
from tests.gguf_from_hf import build
from tests.gguf_split import split_gguf, with_metadata
from tests.load.test_load_refusal import limits
from tests.tui.conftest import tui_dirs  # noqa: F401 -- private data, config, cache and models folders
from tests.tui.helpers import open_models, wait_for
from tests.tui.test_devices import screen_lines

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

GIB = 2**30


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """LFM2-MoE (only llama.cpp runs it: auto picks llama.cpp) as converted for 8192 positions, so that its cache
    outweighs its weights; and the same split in two parts."""
    folder = tmp_path_factory.mktemp("fit")
    long = with_metadata(build("lfm2moe", folder / "hf").gguf, folder / "lfm2-long.gguf",
                         lfm2moe__context_length=8192)
    return {"long": [long], "split": split_gguf(long, folder / "split" / "lfm2-split.gguf", 2)}


class Sizes:
    """A GGUF's bytes read straight from its header: every tensor, the token embeddings, each layer's experts."""

    def __init__(self, parts):
        tensors = [(t.name, int(t.n_bytes)) for part in parts for t in GGUFReader(part).tensors]
        self.total = sum(n for _, n in tensors)
        self.embeddings = sum(n for name, n in tensors if name.startswith("token_embd."))
        self.experts = {}
        for name, n in tensors:
            if m := re.match(r"blk\.(\d+)\.ffn_\w+_exps\.", name):
                self.experts[int(m.group(1))] = self.experts.get(int(m.group(1)), 0) + n
        self.shape = fit.gguf_shape(open_gguf(parts[0], GGUFReader))
        self.kv_per_position = self.shape.kv_per_position
        self.state = self.shape.state_per_sequence  # LFM2's short convolutions: llama.cpp's RS buffer, a sequence

    def in_ram(self, kept: int) -> int:
        """What llama.cpp holds in RAM beside a GPU with the first `kept` layers' experts there: those experts and the
        token embeddings, the file read into page-locked memory (engine.llamacpp.placement.Placement.page_locked)."""
        return self.embeddings + sum(self.experts.get(layer, 0) for layer in range(kept))

    def before_experts(self, context: int) -> int:
        """What a named GPU budget holds before any expert once some stay in RAM: the other weights llama.cpp puts
        on the GPU, one sequence's cache and recurrent state, and its compute buffer (engine.llamacpp.compute and
        .state: tested on their own)."""
        from moedesk.engine.llamacpp.compute import activation_bytes, offload_copy_bytes

        return (self.shape.other_on_gpu + context * self.kv_per_position + self.state
                + activation_bytes(self.shape.graph, context) + offload_copy_bytes(self.shape.graph, context))


def usable_between(low: int, high: int) -> int:
    """Memory the process may use such that `low` bytes fit it (with the headroom each load keeps) and `high` do not."""
    from moedesk.engine.memory_fit import HEADROOM

    assert low < high
    return int((low + high) / 2 / (1 - HEADROOM))


def machine(monkeypatch, tmp_path, room: int, gpu_free: int | None) -> None:
    """A machine with plenty of RAM in a cgroup with `room` bytes left, and a GPU llama.cpp offloads to with
    `gpu_free` bytes free (None: none; llama.cpp here is a CPU build whatever it is told)."""
    limits(monkeypatch, tmp_path, ram=64 * GIB, memory_max=50 * 2**20 + room)
    monkeypatch.setattr(fit, "llama_gpu", lambda: (gpu_free is not None, gpu_free or 0))


async def screen_says(models, parts, **flags) -> str:
    """The models screen's line for the GGUF `parts` (put in the models folder), highlighted in an app run with
    these flags (device, context_length, gpu_budget), as the exported screenshot shows it."""
    for part in parts:
        shutil.copy(part, models / part.name)
    name = parts[0].name

    def no_model(model, progress):
        raise MoedeskError("no model yet")

    app = MoedeskApp(no_model, model="nothing", **flags)
    async with app.run_test(size=(250, 40)) as pilot:
        await wait_for(pilot, lambda: type(app.screen).__name__ == "LoadingScreen"
                       and str(app.screen.query_one(".load-error").render()), what="the failed start")
        screen = await open_models(pilot)
        table = screen.query_one("#models-table")
        names = [table.get_row_at(i)[1] for i in range(table.row_count)]
        table.move_cursor(row=names.index(name))
        await pilot.pause()
        text = re.sub(r"\s+", " ", " ".join(screen_lines(app)))
    for part in parts:
        (models / part.name).unlink()
    start = text.index(f"{name} · ")
    return text[start:text.index(" models · memory with", start)]


def load(parts, **options):
    return Engine.load(str(parts[0]), **options)


def refusal(parts, **options) -> str:
    with pytest.raises(MoedeskError) as refused:
        load(parts, **options).close()
    message = str(refused.value)
    assert message.startswith(f"{parts[0]} needs ") and "\n" not in message
    return message.removeprefix(f"{parts[0]} ")


async def agree_it_fits(models, parts, flags: dict, options: dict):
    """The screen's line names no shortfall and holds the figures of the placement the load then made."""
    line = await screen_says(models, parts, **flags)
    assert "does not fit" not in line and "llama.cpp: the native engine does not run lfm2moe" in line
    engine = load(parts, **options)
    try:
        assert engine.kind == "llama.cpp" and engine.fit.fits
        assert engine.fit.summary() in line, (engine.fit.summary(), line)
        return engine.fit
    finally:
        engine.close()


async def agree_it_does_not(models, parts, flags: dict, options: dict) -> str:
    """The load refuses it before llama.cpp reads it, and the screen says so in the same words."""
    said = refusal(parts, **options)
    line = await screen_says(models, parts, **flags)
    assert f" · does not fit: {said} · " in line, (said, line)
    return said


async def test_a_gguf_that_fits_only_because_its_experts_go_to_the_gpu(ggufs, tui_dirs, tmp_path, monkeypatch):
    """With a GPU, only the token embeddings stay in RAM (every expert fits on it); without one, the whole file and
    the cache do. The cgroup's room lies between."""
    parts, sizes = ggufs["long"], Sizes(ggufs["long"])
    room = usable_between(sizes.embeddings, sizes.total)
    machine(monkeypatch, tmp_path, room, gpu_free=8 * GIB)
    placed = await agree_it_fits(tui_dirs["models"], parts, {}, {})
    assert placed.ram_bytes == sizes.embeddings and placed.placement.cpu_moe == 0
    # on the GPU the rest, the head's copy of the (tied) embeddings, the cache and the short convolutions' state
    assert placed.gpu_bytes == sizes.total + 4096 * sizes.kv_per_position + sizes.state
    assert placed.context == 4096  # the engine's default, within the 8192 the file was converted for

    said = await agree_it_does_not(tui_dirs["models"], parts, {"device": "cpu"}, {"device": "cpu"})
    assert "does not fit this machine's memory in any form" in said  # no context leaves room for the weights
    machine(monkeypatch, tmp_path, room, gpu_free=None)  # the same machine without the GPU: the same refusal
    assert await agree_it_does_not(tui_dirs["models"], parts, {}, {}) == said


async def test_a_split_gguf_that_fits_only_at_a_shorter_context_loads_at_the_one_named(ggufs, tui_dirs, tmp_path,
                                                                                      monkeypatch):
    """No GPU: the whole model (every part) and the cache at 8192 positions stay in RAM; the room holds the cache of
    2048 positions but not of 4096, so both name --context 2048, and at 2048 it loads as the screen said."""
    parts, sizes = ggufs["split"], Sizes(ggufs["split"])
    need = {c: sizes.total + c * sizes.kv_per_position + sizes.state for c in (2048, 4096, 8192)}
    machine(monkeypatch, tmp_path, usable_between(need[2048], need[4096]), gpu_free=None)
    long, short = {"context_length": 8192}, {"context_length": 2048}
    said = await agree_it_does_not(tui_dirs["models"], parts, long, long)
    assert said.endswith("; try --context 2048")
    placed = await agree_it_fits(tui_dirs["models"], parts, short, short)
    assert placed.ram_bytes == need[2048] and placed.gpu_bytes == 0 and placed.context == 2048


async def test_a_named_budget_keeps_the_first_layers_experts_in_ram_on_both(ggufs, tui_dirs, tmp_path, monkeypatch):
    """A --gpu-budget that holds the other weights, the cache, llama.cpp's compute buffer and one and a half layers'
    experts: the last layer's
    experts go to the GPU, the others stay in RAM (as llama.cpp's --n-cpu-moe 3), on the screen as in the load; and
    a room too small for those is refused by both."""
    parts, sizes = ggufs["long"], Sizes(ggufs["long"])
    layer = max(sizes.experts.values())
    budget = (sizes.before_experts(512) + 1.5 * layer) / GIB  # no slack: llama.cpp's buffers are whole
    in_ram = sizes.in_ram(3)
    assert in_ram == sizes.embeddings + sum(sizes.experts.values()) - sizes.experts[max(sizes.experts)]
    options = {"context_length": 512, "gpu_budget": budget}
    machine(monkeypatch, tmp_path, usable_between(in_ram, sizes.total), gpu_free=8 * GIB)
    placed = await agree_it_fits(tui_dirs["models"], parts, options, options)
    assert placed.ram_bytes == in_ram and placed.placement.cpu_moe == 3
    assert "experts of 3 of 4 layers in RAM, " in placed.summary()

    machine(monkeypatch, tmp_path, usable_between(sizes.embeddings, in_ram), gpu_free=8 * GIB)
    assert "does not fit this machine's memory" in await agree_it_does_not(tui_dirs["models"], parts, options,
                                                                          options)


def llama_buffers(log: list[str]) -> dict[str, int]:
    """Bytes of each buffer llama.cpp's load log reports (its model, KV and RS buffers, in MiB with two decimals),
    summed by where they are: "CPU" (CPU, CPU_Mapped, ..., and a GPU's page-locked CUDA_Host) or the GPU's name."""
    found: dict[str, int] = {}
    for line in log:
        if m := re.search(r"(\S+) (?:model|KV|RS) buffer size =\s+([\d.]+) MiB", line):
            where = "CPU" if m.group(1).startswith("CPU") or m.group(1).endswith("_Host") else m.group(1)
            found[where] = found.get(where, 0) + int(float(m.group(2)) * 2**20)
    return found


def loaded_with_log(path, **options):
    from moedesk.engine.llamacpp.library import library

    mark = library().log_mark()
    engine = Engine.load(str(path), engine="llama.cpp", **options)
    return engine, library().log_since(mark)


@pytest.mark.parametrize("which", ["lfm2moe", "demo"])
def test_what_the_plan_puts_in_ram_is_what_llama_cpp_allocates(which, ggufs, tmp_path, monkeypatch):
    """The figures the screen and the load show, against llama.cpp's own: on the CPU, its model buffers and KV cache
    (the cache only in the layers that have attention, as LFM2's per-layer head counts say) add up to the plan's
    RAM, within the log's rounding."""
    from moedesk.engine.load.demo import source_gguf

    path = ggufs["long"][0] if which == "lfm2moe" else source_gguf()
    engine, log = loaded_with_log(path, device="cpu", context_length=1024)
    try:
        buffers = llama_buffers(log)
        assert set(buffers) == {"CPU"}, log
        assert abs(buffers["CPU"] - engine.fit.ram_bytes) <= 0.01 * 2**20 + 0.005 * engine.fit.ram_bytes, \
            (buffers, engine.fit)
    finally:
        engine.close()


@pytest.mark.gpu
def test_what_the_plan_puts_on_the_gpu_is_what_llama_cpp_allocates(tmp_path):
    """On the GPU box, with llama-cpp-python built with CUDA: a Qwen3-MoE GGUF (an untied head) with a budget that
    keeps some layers' experts in RAM; llama.cpp's CPU buffers hold the plan's RAM and its GPU buffers the plan's
    GPU bytes (its compute buffers aside), within 2%."""
    from moedesk.engine.llamacpp.library import library

    if not library().gpu_offload():
        pytest.skip("llama-cpp-python here is a CPU build (rebuild it with CUDA on the GPU box)")
    path = build("qwen3moe", tmp_path / "q").gguf
    sizes = Sizes([path])
    budget = (sizes.before_experts(512) + 1.5 * max(sizes.experts.values())) / GIB
    engine, log = loaded_with_log(path, context_length=512, gpu_budget=budget)
    try:
        buffers = llama_buffers(log)
        gpu = sum(n for where, n in buffers.items() if where != "CPU")
        assert 0 < engine.fit.placement.cpu_moe < len(sizes.experts), engine.fit
        assert abs(buffers.get("CPU", 0) - engine.fit.ram_bytes) <= 0.02 * engine.fit.ram_bytes, (buffers, engine.fit)
        assert abs(gpu - engine.fit.gpu_bytes) <= 0.02 * engine.fit.gpu_bytes, (buffers, engine.fit)
    finally:
        engine.close()


@pytest.mark.parametrize("gpu_free", [None, 8 * GIB])
def test_serve_weighs_a_llama_cpp_model_as_its_load_plans_it(gpu_free, ggufs, tmp_path, monkeypatch):
    """`moedesk serve` refuses a model that does not fit before unloading the one it has: for a GGUF llama.cpp runs, by
    the RAM its load would plan (the cache in RAM without a GPU, only the embeddings with one), not the file's size."""
    from moedesk.app.cli import build_parser, serve_pool

    parts, sizes = ggufs["long"], Sizes(ggufs["long"])
    machine(monkeypatch, tmp_path, 16 * GIB, gpu_free)
    args = build_parser().parse_args(["serve", "--model", str(parts[0]), "--context", "2048"])
    need = serve_pool(args, args.model, lambda source: None, 300).need(str(parts[0]))
    engine = load(parts, context_length=2048)
    try:
        assert need == engine.fit.ram_bytes
        assert need == (sizes.embeddings if gpu_free else sizes.total + 2048 * sizes.kv_per_position + sizes.state)
    finally:
        engine.close()


def test_the_download_wizard_plans_a_hub_gguf_as_its_load_will(ggufs, tmp_path, monkeypatch):
    """Before a GGUF only llama.cpp runs is downloaded, the wizard reads its header from the Hub's first bytes: its
    line is the plan the load of the downloaded file makes on this machine, whole (weights and cache) as the total
    it weighs against RAM + VRAM."""
    from moedesk.app.download import DownloadChoice
    from moedesk.app.tui.load_target import LoadTarget
    from moedesk.app.tui.screens.download import loaded_estimate
    from moedesk.engine.load.gguf_header import parse_header
    from moedesk.engine.load.size_estimate import summarize_gguf_header

    path = ggufs["long"][0]
    machine(monkeypatch, tmp_path, 16 * GIB, gpu_free=8 * GIB)
    weights = summarize_gguf_header(parse_header(path.read_bytes(), path), path)
    choice = DownloadChoice("F32", "gguf", (path.name,), path.stat().st_size, (path.name,))
    text, total = loaded_estimate(choice, weights, LoadTarget("auto", "float32", False, context=2048))
    engine = load([path], context_length=2048)
    try:
        assert text == f"{engine.fit.line()} · llama.cpp: the native engine does not run lfm2moe"
        assert total == engine.fit.ram_bytes + engine.fit.gpu_total and "on the GPU" in text
    finally:
        engine.close()
