"""The download wizard, driven through Pilot, with the real huggingface_hub client talking to tests/fake_hub.py."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from moedesk.app import download as dl
from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.settings import Settings
from moedesk.app.tui.screens import download as wizard
from moedesk.app.tui.screens.download import DownloadScreen
from moedesk.app.tui.load_target import LoadTarget
from moedesk.app.tui.screens.models import ModelsScreen
from tests.fake_hub import FakeHub, point_client_at
from tests.tui.helpers import apply_setting, chat_ready, screen_lines, wait_for

pytestmark = pytest.mark.timeout(90)

CHUNK = 16 * 1024  # huggingface_hub reads 10 MB at a time; small chunks let a 1 MB file arrive in pieces
REPO = "moe/tiny-moe"
WEIGHTS = "model.safetensors"


def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def gguf_file(name: str, layers, H: int, F: int) -> bytes:
    """A Mixtral-like GGUF written by the gguf package: a real header for the estimate to read."""
    import tempfile

    from tests.load.test_gguf_header import write_moe_gguf

    with tempfile.TemporaryDirectory() as folder:
        [path] = write_moe_gguf(Path(folder) / name, layers=layers, H=H, F=F)
        return path.read_bytes()


GGUFS = {"tiny-moe-Q4_K_M.gguf": gguf_file("tiny-moe-Q4_K_M.gguf", (("q4_k", "q4_k"), ("q4_k", "q8_0")), 256, 256),
         "tiny-moe-Q8_0.gguf": gguf_file("tiny-moe-Q8_0.gguf", (("q8_0", "q8_0"),) * 2, 256, 256)}
SNAP_CONFIG = {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "intermediate_size": 512,
               "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
               "max_position_embeddings": 4096}


def snap_shards() -> dict[str, bytes]:
    """A bf16 Qwen3-MoE checkpoint of zeros in two shards: real headers for the memory estimate to read."""
    import torch
    from safetensors.torch import save

    c = SNAP_CONFIG
    H, E, W, V = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"], c["vocab_size"]
    shards = []
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes = {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (128, H),
                  p + "self_attn.v_proj.weight": (128, H), p + "self_attn.o_proj.weight": (H, H),
                  p + "self_attn.q_norm.weight": (64,), p + "self_attn.k_norm.weight": (64,),
                  p + "mlp.gate.weight": (E, H)}
        for e in range(E):
            shapes.update({f"{p}mlp.experts.{e}.{proj}.weight": shape for proj, shape in
                           (("gate_proj", (W, H)), ("up_proj", (W, H)), ("down_proj", (H, W)))})
        shapes.update({"model.embed_tokens.weight": (V, H)} if layer == 0 else
                      {"lm_head.weight": (V, H), "model.norm.weight": (H,)})
        shards.append(save({name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}))
    return {f"model-0000{n}-of-00002.safetensors": data for n, data in enumerate(shards, 1)}


FIXED = {  # bytes that never change, so the snapshot's commit hash and sizes never do
    "config.json": json.dumps(SNAP_CONFIG).encode(),
    "tokenizer.json": b'{"version": "1.0"}',
    **snap_shards(),
    "README.md": b"# snap\n",
    "snap-Q4_K_M.gguf": blob(5, 1_200_000),
    "snap-Q8_0.gguf": blob(6, 2_400_000),
}


LFM = "moe/tiny-lfm2"  # a safetensors checkpoint of an architecture the native engine does not implement


def lfm_files() -> dict[str, bytes]:
    import torch
    from safetensors.torch import save

    config = {"model_type": "lfm2_moe", "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 128}
    return {"config.json": json.dumps(config).encode(), "tokenizer.json": b'{"version": "1.0"}',
            "model.safetensors": save({"model.embed_tokens.weight": torch.zeros(128, 64, dtype=torch.bfloat16)})}


@pytest.fixture
def hub(tui_dirs, tiny_folder, monkeypatch):
    """A fake Hub serving the tiny test model (loadable) plus GGUF files, and huggingface_hub pointed at it.

    huggingface_hub reads HF_ENDPOINT / HF_HOME / HF_HUB_CACHE when it is imported, so its constants are patched
    (tests/app/test_download.py covers the environment route in a fresh process); the cache is tui_dirs' empty one.
    """
    from huggingface_hub.utils import close_session

    fake = FakeHub()
    files = {p.name: p.read_bytes() for p in tiny_folder.iterdir() if p.is_file()}
    fake.add_repo(REPO, {**files, "README.md": b"# tiny\n", **GGUFS})
    fake.add_repo("moe/gated", {"config.json": b"{}", "model.safetensors": blob(10, 20_000)}, gated=True)
    fake.add_repo("moe/snap", FIXED)
    fake.add_repo(LFM, lfm_files())
    fake.start()
    home = tui_dirs["cache"] / "hf-home"
    point_client_at(fake, monkeypatch, home, tui_dirs["hf-cache"], CHUNK)
    monkeypatch.setattr(dl, "GGUF_HEADER_FIRST_BYTES", 16 * 1024)  # the GGUFs here are smaller than the default
    yield fake
    fake.stop()
    close_session()  # drop pooled keep-alive connections to this server


def repo_dir(repo_id: str = REPO) -> Path:
    return Path(dl.hf_cache_dir()) / ("models--" + repo_id.replace("/", "--"))


def partials(repo_id: str = REPO) -> list[Path]:
    return sorted((repo_dir(repo_id) / "blobs").glob("*.incomplete"))


def gguf_estimate(tmp_path, name: str, target: LoadTarget) -> str:
    """What the fit view says of a GGUF choice: the estimate of the file on disk, for the settings in force."""
    from moedesk.app.tui.catalog import estimate_line
    from moedesk.engine.load.size_estimate import summarize_path

    path = tmp_path / name
    path.write_bytes(GGUFS[name])
    estimate = summarize_path(path).estimate(target.expert_dtype, target.weights_dtype)
    return f"loaded  {estimate_line(estimate, target.gpu, dl.format_bytes)} · expert dtype {target.expert_dtype} (F2)"


def status(screen) -> str:
    return str(screen.query_one("#download-status").render())


def option_texts(screen) -> list[str]:
    choices = screen.query_one("#download-choices")
    return [str(choices.get_option_at_index(i).prompt) for i in range(choices.option_count)]


async def open_wizard(pilot) -> DownloadScreen:
    """From the chat, with keys only: F3 (models), F6 (download)."""
    app = pilot.app
    await wait_for(pilot, lambda: chat_ready(app), what="the chat")
    await pilot.press("f3")
    await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen), what="the models screen")
    await pilot.press("f6")
    await wait_for(pilot, lambda: isinstance(app.screen, DownloadScreen), what="the wizard")
    assert app.screen.focused is app.screen.query_one("#download-repo")
    return app.screen


async def download_default_choice(pilot, repo_id: str) -> DownloadScreen:
    """Open the wizard, list the repo, download the highlighted choice, wait until it stopped."""
    screen = await open_wizard(pilot)
    await list_repo(pilot, screen, repo_id)
    await pilot.press("enter")
    await wait_stopped(pilot, screen)
    return screen


async def list_repo(pilot, screen: DownloadScreen, repo_id: str) -> None:
    """Type the repo id (replacing what is there) and press Enter; wait for choices or an error."""
    screen.query_one("#download-repo").focus()
    screen.query_one("#download-repo").value = ""
    await pilot.press(*repo_id, "enter")
    failed = lambda: "-error" in screen.query_one("#download-status").classes  # noqa: E731
    await wait_for(pilot, lambda: screen.listing is not None or failed(), what=f"the listing of {repo_id}")


async def set_engine(pilot, screen: DownloadScreen, value: str) -> None:
    """The engine setting changed in the settings screen, back at the wizard once it follows it."""
    await apply_setting(pilot, "engine", value)
    await wait_for(pilot, lambda: screen.target.engine == value, what=f"the wizard with engine {value}")


async def wait_stopped(pilot, screen: DownloadScreen, what: str = "the download to stop") -> None:
    await wait_for(pilot, lambda: not screen.downloading, what=what)


# -- listing ---------------------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_lists_the_choices_with_sizes_and_what_fits(hub, engine, tmp_path):
    app = MoedeskApp(engine)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await open_wizard(pilot)
        await list_repo(pilot, screen, REPO)

        listing = screen.listing
        assert [c.name for c in listing.choices] == ["safetensors", "Q4_K_M", "Q8_0"]
        safetensors = listing.choices[0]
        assert WEIGHTS in safetensors.files and "README.md" not in safetensors.files
        texts = option_texts(screen)
        assert texts[0].startswith("safetensors checkpoint") and f"{len(safetensors.files)} files" in texts[0]
        assert texts[0].endswith(dl.format_bytes(safetensors.total_bytes))
        q4_size, q8_size = (dl.format_bytes(len(data)) for data in GGUFS.values())
        assert texts[1].startswith("GGUF Q4_K_M") and "1 file" in texts[1] and texts[1].endswith(q4_size)
        assert texts[2].startswith("GGUF Q8_0") and texts[2].endswith(q8_size)
        assert f"{REPO} @ {hub.repos[REPO].commit[:12]}: 3 choices" in status(screen)

        # The default (the safetensors checkpoint) is highlighted, with its fit; moving shows the next one's.
        assert screen.focused is screen.query_one("#download-choices")
        fit = screen.query_one("FitView")
        size_line = lambda: str(fit.query_one(".fit-size").render())  # noqa: E731
        assert size_line() == f"safetensors checkpoint · {len(safetensors.files)} files · " \
                              f"{dl.format_bytes(safetensors.total_bytes)} to download"
        assert "fits" in str(fit.query_one(".fit-disk").render()) and "-no-room" not in fit.classes
        assert "RAM " in str(fit.query_one(".fit-memory").render())
        # What it takes once loaded, from config.json and the header alone: on this CPU float32, experts as stored.
        loaded = lambda: str(fit.query_one(".fit-loaded").render())  # noqa: E731
        await wait_for(pilot, lambda: "reading" not in loaded(), what="the estimate")
        experts = sum(moe.experts.nbytes for moe in engine.model.moe_blocks())
        total = experts + sum(p.numel() * p.element_size() for p in engine.model.parameters())
        assert loaded() == (f"loaded  ~{dl.format_bytes(total)} in RAM, {dl.format_bytes(experts)} of it f32 experts"
                            " · expert dtype auto (F2)")
        await pilot.press("down")
        assert size_line() == f"GGUF Q4_K_M · 1 file · {q4_size} to download"
        # A GGUF's from its header, fetched from the file's start: the estimate of the file itself once on disk.
        await wait_for(pilot, lambda: "reading" not in loaded(), what="the GGUF estimate")
        assert loaded() == gguf_estimate(tmp_path, "tiny-moe-Q4_K_M.gguf", screen.target)
        assert "q4_k/q8_0 experts" in loaded()
        assert not screen.query_one("#download-start").disabled
        # Listing fetched metadata and read headers only: config.json whole, the weights' first bytes, nothing else.
        whole = [r.path for r in hub.requests if r.method == "GET" and ("/resolve/" in r.path or r.server == "cdn")
                 and not r.bounded]
        assert whole and all(path.endswith("/config.json") for path in whole), whole
        assert not hub.gets(REPO, WEIGHTS) and hub.gets(REPO, WEIGHTS, headers=True)
        [header] = hub.gets(REPO, "tiny-moe-Q4_K_M.gguf", headers=True)
        assert header.range == f"bytes=0-{16 * 1024 - 1}"  # the first range (set small here) held the header
        assert not list(Path(dl.hf_cache_dir()).iterdir())  # and nothing of it was written to the cache


@pytest.mark.anyio
async def test_a_pull_short_name_lists_its_repo_with_its_quantisation_highlighted(hub, engine, monkeypatch):
    from moedesk.app import pull_catalogue

    monkeypatch.setitem(pull_catalogue.CATALOGUE, "tiny:1b",
                        pull_catalogue.CatalogueEntry(REPO, "Q8_0", REPO, "a test model"))
    app = MoedeskApp(engine)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await open_wizard(pilot)
        for typed, picked in (("tiny:1b", "Q8_0"), ("Tiny:1B:q4_k_m", "Q4_K_M"), ("tiny:1b:safetensors", "safetensors")):
            await list_repo(pilot, screen, typed)
            assert screen.listing.repo_id == REPO and screen.highlighted_choice().name == picked, typed
            assert f"{REPO} @ " in status(screen) and "-error" not in screen.query_one("#download-status").classes
        await list_repo(pilot, screen, "tiny:1b:q2_k")  # a tag the repo lacks: the default, and a word about it
        assert screen.highlighted_choice().name == "safetensors" and "no q2_k here" in status(screen)
        await list_repo(pilot, screen, "tiny:2b")  # neither a short name nor a repo id: one line naming the names
        assert status(screen).startswith("'tiny:2b' is neither a repo id (OWNER/NAME) nor a short name moedesk knows")
        assert "tiny:1b" in status(screen) and "-error" in screen.query_one("#download-status").classes


@pytest.mark.anyio
async def test_the_estimate_follows_the_expert_dtype_setting(hub, engine, tmp_path):
    """int4 from the settings: the tiny model's gate/up rows (64 wide) become q4_0, 18 bytes per 32 weights; its
    down rows (48 wide: not whole blocks) stay float32. F2 in the wizard to bf16 turns the experts 16-bit (float32
    on this CPU); a GGUF's header, read once, is estimated again for the new setting as well."""
    cfg = engine.config
    E, H, F, L = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_layers
    other = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    int4 = L * E * (2 * F * H // 32 * 18 + H * F * 4)
    app = MoedeskApp(engine, settings=Settings(expert_dtype="int4"))
    async with app.run_test(size=(120, 30)) as pilot:
        screen = await open_wizard(pilot)
        await list_repo(pilot, screen, REPO)
        fit = screen.query_one("FitView")
        loaded = lambda: str(fit.query_one(".fit-loaded").render())  # noqa: E731
        await wait_for(pilot, lambda: "reading" not in loaded(), what="the estimate")
        assert loaded() == (f"loaded  ~{dl.format_bytes(int4 + other)} in RAM, {dl.format_bytes(int4)} of it "
                            "q4_0/f32 experts · expert dtype int4 (F2)")

        await apply_setting(pilot, "expert_dtype", "bf16")
        await wait_for(pilot, lambda: "bf16" in loaded(), what="the new estimate")
        experts = sum(moe.experts.nbytes for moe in engine.model.moe_blocks())  # float32 on this CPU
        assert loaded() == (f"loaded  ~{dl.format_bytes(experts + other)} in RAM, {dl.format_bytes(experts)} of it "
                            "f32 experts · expert dtype bf16 (F2)")
        await pilot.press("down")
        await wait_for(pilot, lambda: "reading" not in loaded(), what="the GGUF estimate")
        assert loaded() == gguf_estimate(tmp_path, "tiny-moe-Q4_K_M.gguf", screen.target)
        assert loaded().endswith("f32 experts · expert dtype bf16 (F2)")
        await apply_setting(pilot, "expert_dtype", "auto")
        await wait_for(pilot, lambda: "auto" in loaded(), what="the new estimate")
        assert loaded() == gguf_estimate(tmp_path, "tiny-moe-Q4_K_M.gguf", screen.target)
        assert "q4_k/q8_0 experts" in loaded()
        assert len(hub.gets(REPO, WEIGHTS, headers=True)) == 1  # read once, estimated again from what was read
        assert len(hub.gets(REPO, "tiny-moe-Q4_K_M.gguf", headers=True)) == 1


@pytest.mark.anyio
async def test_a_native_gguf_is_planned_for_the_engine_the_setting_names(hub, engine, tmp_path):
    """A GGUF the native engine runs (Mixtral's llama architecture): with the engine setting auto, the native
    estimate; set to llama.cpp (F2 in the wizard), the llama.cpp engine's plan for the same header, figures equal to
    engine.selection's plan of the file on disk, as the Models screen shows it. Back to auto, the native one again."""
    from moedesk.engine.selection import llama_cpp_plan

    app = MoedeskApp(engine)
    async with app.run_test(size=(120, 30)) as pilot:
        screen = await open_wizard(pilot)
        await list_repo(pilot, screen, REPO)
        await pilot.press("down")
        fit = screen.query_one("FitView")
        loaded = lambda: str(fit.query_one(".fit-loaded").render())  # noqa: E731
        await wait_for(pilot, lambda: "reading" not in loaded(), what="the GGUF estimate")
        native = gguf_estimate(tmp_path, "tiny-moe-Q4_K_M.gguf", screen.target)
        assert loaded() == native

        await set_engine(pilot, screen, "llama.cpp")
        target = screen.target
        plan = llama_cpp_plan(tmp_path / "tiny-moe-Q4_K_M.gguf", "llama.cpp", target.device, target.context,
                              target.gpu_budget)
        assert plan is not None and llama_cpp_plan(tmp_path / "tiny-moe-Q4_K_M.gguf", "auto") is None
        assert loaded() == f"loaded  {plan.line()} · llama.cpp engine, as set"
        choice = screen.highlighted_choice()
        text, total = wizard.loaded_estimate(choice, screen.weights[choice.name], target)
        assert total == plan.ram_bytes + plan.gpu_total
        assert len(hub.gets(REPO, "tiny-moe-Q4_K_M.gguf", headers=True)) == 1  # planned from the header read once

        await set_engine(pilot, screen, "auto")
        assert loaded() == native


@pytest.mark.anyio
@pytest.mark.parametrize("size", [(80, 24), (160, 50)])
async def test_a_safetensors_choice_says_where_the_engine_setting_would_stop_its_load(hub, engine, size):
    """llama.cpp reads GGUF files only. A safetensors choice with the engine set to llama.cpp: instead of the native
    estimate, the line Engine.load stops with once it is downloaded; auto estimates it natively where the native
    engine implements its architecture, and says what would run it where it does not. At 160x50 the line wraps
    whole inside the fit view; at 80x24 its brief shows (the whole in its tooltip), and at both the buttons stay on
    screen, whatever the lines above them say."""
    from moedesk.engine.errors import MoedeskError
    from moedesk.engine.runtime import Engine
    from moedesk.engine.selection import not_gguf

    short = size == (80, 24)
    app = MoedeskApp(engine)
    async with app.run_test(size=size) as pilot:
        screen = await open_wizard(pilot)
        fit = screen.query_one("FitView")
        loaded = lambda: str(fit.query_one(".fit-loaded").render())  # noqa: E731
        assert ("-short" in screen.classes) == short

        def on_screen() -> str:
            """The fit view's `loaded` rows as exported, the border's sides cut off, joined as the words wrap: up to
            the note, or to the view's last row on screen."""
            rows = [row.strip() for row in screen_lines(app)]
            start = next(i for i, row in enumerate(rows) if row.startswith("│ loaded"))
            shown = []
            for row in rows[start:]:
                text = row.strip("│ ")
                if not row.startswith("│") or text.startswith("the weights"):
                    break
                shown.append(text)
            return " ".join(" ".join(shown).split())

        def shows(stop: str) -> None:
            """What the fit view shows of `stop` (the brief on a short screen, its tooltip the whole), with the
            buttons below it on screen."""
            lines = screen_lines(app)
            print("\n".join(lines))  # shown when the test fails
            whole = f"loaded  {stop}"
            assert loaded() == whole
            if short:
                assert on_screen() == " ".join(f"loaded  {wizard.brief(stop)}".split())
                assert fit.query_one(".fit-brief").tooltip == stop
            else:
                assert on_screen() == " ".join(whole.split())  # every word of it shows
            buttons_shown()

        def buttons_shown() -> None:
            """Download (and Load model, once there is something to load) inside the screen, above the footer, and
            in its export. (screen_lines leaves blank rows out: the labels are looked for by their words.)"""
            lines = screen_lines(app)
            assert "Back / cancel download" in lines[-1]  # the footer: the export's last row
            labels = {"#download-start": "Download"} | ({"#download-load": "Load model"} if screen.spec else {})
            for wid, label in labels.items():
                button = screen.query_one(wid)
                assert button.display and button.region.bottom <= size[1] - 1, (label, button.region, "\n".join(lines))
                assert any(re.search(rf"\b{label}\b", row) for row in lines[:-1]), "\n".join(lines)

        await list_repo(pilot, screen, REPO)  # the native engine runs it (qwen3_moe)
        assert screen.highlighted_choice().kind == "safetensors"
        await wait_for(pilot, lambda: "reading" not in loaded(), what="the estimate")
        native = loaded()
        assert native.startswith("loaded  ~") and "in RAM" in native  # auto: the native estimate
        assert on_screen() == " ".join(native.split()) and "-briefed" not in fit.classes  # an estimate shows whole
        buttons_shown()

        await set_engine(pilot, screen, "llama.cpp")
        stop = not_gguf("llama.cpp")
        assert "~" not in loaded()
        assert "reads GGUF files only" in stop and "auto or native" in stop and "GGUF of this model" in stop
        assert wizard.brief(stop) == "the llama.cpp engine reads GGUF files only, so with the engine set to " \
                                     "llama.cpp it would not load"
        shows(stop)

        await list_repo(pilot, screen, LFM)  # the native engine refuses lfm2_moe
        await wait_for(pilot, lambda: "reading" not in loaded(), what="the refusal")
        problem = "unsupported architecture 'lfm2_moe'"
        lfm_stop = loaded().removeprefix("loaded  ")
        assert lfm_stop.startswith("the llama.cpp engine reads GGUF files only") and problem in lfm_stop
        assert "auto or native" not in lfm_stop and lfm_stop.endswith("use a GGUF of this model")
        assert wizard.brief(lfm_stop) == f"{wizard.brief(stop)}, nor natively"
        shows(lfm_stop)

        # What the load of each, once downloaded, stops with: the same words.
        await pilot.press("enter")
        await wait_stopped(pilot, screen)
        assert screen.spec == LFM, status(screen)
        # The progress bar, the status and the snapshot's folder join the buttons at the bottom (at 80x24 the folder
        # on one line: test_after_a_download_at_80x24_the_fit_box_stays_whole).
        shows(lfm_stop)
        with pytest.raises(MoedeskError) as refused:
            Engine.load(LFM, engine="llama.cpp")
        assert str(refused.value) == f"{LFM}: {lfm_stop}"

        await set_engine(pilot, screen, "auto")  # the native engine refuses it and llama.cpp has no GGUF to read
        auto_stop = loaded().removeprefix("loaded  ")
        assert auto_stop.startswith(problem) and auto_stop.endswith("reads GGUF files only: use a GGUF of this model")
        assert wizard.brief(auto_stop) == f"{problem}, and the llama.cpp engine reads GGUF files only"
        shows(auto_stop)
        with pytest.raises(MoedeskError) as refused:
            Engine.load(LFM, engine="auto")
        assert str(refused.value).endswith(f": {auto_stop}")

        await list_repo(pilot, screen, REPO)
        await pilot.press("enter")
        await wait_stopped(pilot, screen)
        assert screen.spec == REPO, status(screen)
        buttons_shown()
        with pytest.raises(MoedeskError) as refused:
            Engine.load(REPO, engine="llama.cpp")
        assert str(refused.value) == f"{REPO}: {stop}"
        assert loaded() == native  # auto again: the native estimate


def test_a_brief_is_the_first_clause_without_its_asides():
    assert wizard.brief("no (really: none) such thing; try another: here") == "no such thing"
    assert wizard.brief("unsupported architecture 'x' (supported: a, b), and more: advice") == \
        "unsupported architecture 'x', and more"
    assert wizard.brief("one whole line") == "one whole line"


@pytest.mark.anyio
async def test_no_estimate_is_one_line_and_the_fit_weighs_the_estimate(hub, engine, monkeypatch):
    """A header that cannot be read: one line instead of the estimate. Memory that the file's size would overflow
    but the int4 estimate does not: the note goes by the estimate."""
    app = MoedeskApp(engine, settings=Settings(expert_dtype="int4"))
    async with app.run_test(size=(120, 30)) as pilot:
        screen = await open_wizard(pilot)
        await list_repo(pilot, screen, "moe/gated")
        fit = screen.query_one("FitView")
        loaded = lambda: str(fit.query_one(".fit-loaded").render())  # noqa: E731
        await wait_for(pilot, lambda: "reading" not in loaded(), what="the estimate")
        assert loaded().startswith("loaded  no estimate before downloading: moe/gated is a gated model")
        assert "\n" not in loaded()

        size = next(c for c in dl.list_repo_files_with_sizes(REPO).choices if c.kind == "safetensors").total_bytes
        monkeypatch.setattr(dl, "check_fits", lambda needed, target=None: dl.FitReport(
            needed, Path("/hf"), 500 * dl.GB, dl.disk_margin(needed), size - 100_000, 0, None, None))
        await list_repo(pilot, screen, REPO)
        await wait_for(pilot, lambda: "reading" not in loaded(), what="the estimate")
        assert "q4_0/f32 experts" in loaded() and "-too-big" not in fit.classes
        assert str(fit.query_one(".fit-note").render()).startswith("the weights fit in RAM + VRAM together")

        # A GGUF choice whose file is no GGUF: its header says so, in one line.
        await list_repo(pilot, screen, "moe/snap")
        await pilot.press("down")
        await wait_for(pilot, lambda: "reading" not in loaded() and "GGUF" in loaded(), what="the GGUF estimate")
        assert loaded() == ("loaded  no estimate before downloading: moe/snap/snap-Q4_K_M.gguf: "
                            "not a GGUF file (bad magic)")


def test_the_estimate_waits_for_the_gguf_header():
    target = LoadTarget("auto", "float32", gpu=False)
    one = dl.DownloadChoice("Q4_K_M", "gguf", ("m-Q4_K_M.gguf",), 10, ("*Q4_K_M*.gguf",))
    split = dl.DownloadChoice("Q8_0", "gguf", ("m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"), 20,
                              ("*Q8_0*.gguf",))
    assert wizard.loaded_estimate(one, None, target) == ("reading the GGUF header for an estimate…", None)
    assert wizard.loaded_estimate(split, None, target) == ("reading the GGUF headers for an estimate…", None)


@pytest.mark.anyio
async def test_app_action_opens_the_wizard_over_the_models_screen(hub, engine):
    """The command palette's "Download a model": Esc from the wizard lands where a download is loaded."""
    app = MoedeskApp(engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        app.action_download()
        await wait_for(pilot, lambda: isinstance(app.screen, DownloadScreen), what="the wizard")
        assert [type(s).__name__ for s in app.screen_stack][-3:] == ["ChatScreen", "ModelsScreen", "DownloadScreen"]
        await pilot.press("escape")
        assert isinstance(app.screen, ModelsScreen)


# -- downloading -----------------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_keyboard_only_download_then_load(hub, engine):
    """Type, Enter, Tab to Download, Enter, and Enter again on "Load model": the downloaded model is the engine."""
    app = MoedeskApp(engine)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await open_wizard(pilot)
        await pilot.press(*REPO, "enter")
        await wait_for(pilot, lambda: screen.listing is not None, what="the listing")
        await pilot.press("tab")
        assert screen.focused is screen.query_one("#download-start")
        await pilot.press("enter")
        await wait_stopped(pilot, screen)
        assert screen.spec == REPO, status(screen)
        assert "downloaded safetensors checkpoint" in status(screen)
        bar = screen.query_one("#download-bar")
        assert bar.progress == bar.total == screen.listing.choices[0].total_bytes

        # huggingface_hub's cache layout: refs/main → snapshots/<commit>/ with links into blobs/.
        commit = hub.repos[REPO].commit
        assert (repo_dir() / "refs" / "main").read_text() == commit
        snapshot = repo_dir() / "snapshots" / commit
        assert sorted(p.name for p in snapshot.iterdir()) == sorted(screen.listing.choices[0].files)
        assert (snapshot / WEIGHTS).is_symlink()
        assert (snapshot / WEIGHTS).read_bytes() == hub.repos[REPO].files[WEIGHTS]
        assert not partials()

        assert screen.focused is screen.query_one("#download-load")
        await pilot.press("enter")
        await wait_for(pilot, lambda: chat_ready(app) and app.engine is not engine, what="the downloaded model")
        assert app.model == REPO and app.engine.name == REPO


@pytest.mark.anyio
async def test_after_a_download_at_80x24_the_fit_box_stays_whole(hub, engine):
    """The finished status names the snapshot's folder, a long path: on a short screen it takes one line (cut with
    an ellipsis, the whole in its tooltip), so the fit box keeps its bottom border and the buttons their place."""
    app = MoedeskApp(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await download_default_choice(pilot, REPO)
        assert screen.spec == REPO, status(screen)
        lines = screen_lines(app)
        print("\n".join(lines))  # shown when the test fails
        fit = screen.query_one("FitView")
        assert fit.region.bottom <= 24 - 1 and fit.region.bottom <= screen.query_one("#download-foot").region.y
        top = next(i for i, row in enumerate(lines) if "will it fit?" in row)
        bottom = next(i for i, row in enumerate(lines) if row.strip().startswith("╰"))
        assert bottom > top and all(row.strip().startswith("│") for row in lines[top + 1:bottom]), "\n".join(lines)
        assert any(row.strip("│ ").startswith("the weights") for row in lines[top:bottom]), "\n".join(lines)
        assert any(re.search(r"\bLoad model\b", row) for row in lines[bottom:-1])
        snapshot = repo_dir() / "snapshots" / hub.repos[REPO].commit
        [where] = [row.strip() for row in lines if row.strip().startswith("files in ")]
        assert where.endswith("…") and f"files in {snapshot}".startswith(where[:-1])
        assert screen.query_one("#download-where").tooltip == str(snapshot)


@pytest.mark.anyio
async def test_gguf_choice_shows_up_in_the_models_list(hub, engine):
    app = MoedeskApp(engine)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await open_wizard(pilot)
        await list_repo(pilot, screen, REPO)
        await pilot.press("down", "enter")  # GGUF Q4_K_M, Enter on the list downloads it
        await wait_stopped(pilot, screen)
        gguf = repo_dir() / "snapshots" / hub.repos[REPO].commit / "tiny-moe-Q4_K_M.gguf"
        assert screen.spec == str(gguf) and gguf.read_bytes() == GGUFS["tiny-moe-Q4_K_M.gguf"]

        await pilot.press("escape")  # back to the models screen, which looks again
        models = app.screen
        assert isinstance(models, ModelsScreen)
        await wait_for(pilot, lambda: any(m.spec == str(gguf) for m in models.models), what="the rescan")
        table = models.query_one("#models-table")
        names = [table.get_row_at(i)[1] for i in range(table.row_count)]
        assert f"{REPO}/tiny-moe-Q4_K_M.gguf" in names


@pytest.mark.anyio
async def test_connection_cut_mid_file_then_the_download_resumes(hub, engine):
    hub.cut_once(REPO, WEIGHTS, after=5 * CHUNK + 100)
    app = MoedeskApp(engine)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await download_default_choice(pilot, REPO)
        assert screen.spec == REPO, status(screen)

    gets = hub.gets(REPO, WEIGHTS)
    assert len(gets) == 2 and gets[0].range is None
    assert gets[1].range == f"bytes={5 * CHUNK}-"  # from the last whole chunk that arrived
    snapshot = repo_dir() / "snapshots" / hub.repos[REPO].commit
    assert (snapshot / WEIGHTS).read_bytes() == hub.repos[REPO].files[WEIGHTS]


@pytest.mark.anyio
async def test_cancel_keeps_the_partial_file_and_the_next_download_resumes_it(hub, engine):
    weights = hub.repos[REPO].files[WEIGHTS]
    release = hub.hold_once(REPO, WEIGHTS, after=4 * CHUNK)  # the transfer stalls there until released
    app = MoedeskApp(engine)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await open_wizard(pilot)
        await list_repo(pilot, screen, REPO)
        choice = screen.listing.choices[0]
        small = choice.total_bytes - len(weights)  # the other files come first, smallest first
        await pilot.press("enter")
        bar = screen.query_one("#download-bar")
        await wait_for(pilot, lambda: bar.progress == small + 4 * CHUNK, what="the stalled transfer")
        assert "Esc cancels" in status(screen) and not screen.query_one("#download-cancel").disabled

        await pilot.press("escape")  # cancels; it does not leave while a download runs
        assert isinstance(app.screen, DownloadScreen) and "cancelling" in status(screen)
        release.set()
        await wait_stopped(pilot, screen)
        assert "partial files are kept" in status(screen) and "resumes" in status(screen)
        assert "\n" not in status(screen) and screen.spec is None

        [partial] = partials()
        assert partial.name == f"{hub.repos[REPO].sha256(WEIGHTS)}.incomplete"
        kept = partial.stat().st_size
        assert kept == 4 * CHUNK and partial.read_bytes() == weights[:kept]
        assert not (repo_dir() / "refs" / "main").exists()  # a half-done snapshot is not the model yet

        statuses = []
        show = screen._status
        screen._status = lambda text, kind="", **where: (statuses.append(text), show(text, kind, **where))
        assert screen.focused is screen.query_one("#download-start")
        await pilot.press("enter")
        await wait_stopped(pilot, screen)
        assert screen.spec == REPO, status(screen)
        assert any(f"resumed: {dl.format_bytes(small + kept)} were on disk already" in s for s in statuses)

    second = hub.gets(REPO, WEIGHTS)[-1]
    assert len(hub.gets(REPO, WEIGHTS)) == 2 and second.range == f"bytes={kept}-"  # only the rest was served
    assert (repo_dir() / "snapshots" / hub.repos[REPO].commit / WEIGHTS).read_bytes() == weights
    assert not partials()


@pytest.mark.anyio
async def test_quitting_mid_download_stops_it_and_a_new_app_resumes(hub, engine, monkeypatch):
    """Quitting (or a crash) mid-file: the download thread stops, and the next run picks up the partial file."""
    import threading

    returned = threading.Event()
    real_download = dl.download

    def download(*args, **kwargs):
        try:
            return real_download(*args, **kwargs)
        finally:
            returned.set()

    monkeypatch.setattr(dl, "download", download)
    release = hub.hold_once(REPO, WEIGHTS, after=3 * CHUNK)
    app = MoedeskApp(engine)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await open_wizard(pilot)
        await list_repo(pilot, screen, REPO)
        await pilot.press("enter")
        await wait_for(pilot, lambda: any(p.stat().st_size == 3 * CHUNK for p in partials()),
                       what="the stalled transfer")
        await pilot.press("ctrl+q")
    release.set()  # the next chunk reaches a download that was told to stop
    assert returned.wait(20)
    assert [p.stat().st_size for p in partials()] == [3 * CHUNK]
    assert not (repo_dir() / "refs" / "main").exists()

    returned.clear()
    again = MoedeskApp(engine)
    async with again.run_test(size=(100, 30)) as pilot:
        screen = await download_default_choice(pilot, REPO)
        assert screen.spec == REPO, status(screen)
    assert hub.gets(REPO, WEIGHTS)[-1].range == f"bytes={3 * CHUNK}-"


# -- errors: one line each -------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_errors_are_one_line(hub, engine, monkeypatch):
    from huggingface_hub import constants

    app = MoedeskApp(engine)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await open_wizard(pilot)

        await list_repo(pilot, screen, "moe/nope")
        assert "moe/nope: no such model on the Hugging Face Hub" in status(screen)
        assert "\n" not in status(screen) and "-error" in screen.query_one("#download-status").classes
        assert screen.query_one("#download-choices").option_count == 0
        assert screen.query_one("#download-start").disabled

        await list_repo(pilot, screen, "moe/gated")  # its file list is public; its files are not
        assert "gated model" in status(screen)
        await pilot.press("enter")
        await wait_stopped(pilot, screen)
        assert "moe/gated is a gated model: accept its licence" in status(screen) and "\n" not in status(screen)

        # Not enough disk: the fit says so before anything is fetched, and downloading stops with one line.
        monkeypatch.setattr(dl.shutil, "disk_usage", lambda path: _Usage(free=200_000))
        await list_repo(pilot, screen, REPO)
        fit = screen.query_one("FitView")
        assert "-no-room" in fit.classes and "NOT enough" in str(fit.query_one(".fit-disk").render())
        await pilot.press("enter")
        await wait_stopped(pilot, screen)
        assert status(screen).startswith("not enough disk space") and "\n" not in status(screen)
        assert not hub.gets(REPO, WEIGHTS)

        # No network: the Hub's address answers nothing.
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        monkeypatch.setattr(constants, "ENDPOINT", dead)
        await list_repo(pilot, screen, REPO)
        assert status(screen).startswith(f"cannot reach {dead}") and "\n" not in status(screen)

        await pilot.press("escape")
        assert isinstance(app.screen, ModelsScreen)


class _Usage:
    def __init__(self, free: int):
        self.total, self.used, self.free = free * 2, free, free


# -- how it looks ----------------------------------------------------------------------------------------------

def fixed_fit(needed: int, target=None) -> dl.FitReport:
    """This machine's disk, RAM and VRAM would change the picture from run to run."""
    return dl.FitReport(needed, Path("/hf"), 500 * dl.GB, dl.disk_margin(needed), 64 * dl.GB, 48 * dl.GB,
                        80 * dl.GB, 70 * dl.GB)


def test_download_wizard_snapshot(snap_compare, hub, engine, monkeypatch):
    monkeypatch.setattr(dl, "check_fits", fixed_fit)
    # As on a GPU box with expert dtype int4, whatever this machine has and the settings say.
    monkeypatch.setattr(wizard, "load_target", lambda app: LoadTarget("int4", "bfloat16", gpu=True))
    engine.name = "tiny-qwen3-moe"

    async def run_before(pilot):
        screen = await open_wizard(pilot)
        await list_repo(pilot, screen, "moe/snap")
        fit = screen.query_one("FitView")
        await wait_for(pilot, lambda: "~" in str(fit.query_one(".fit-loaded").render()), what="the estimate")
        await pilot.pause()

    assert snap_compare(MoedeskApp(engine), terminal_size=(100, 30), run_before=run_before)
