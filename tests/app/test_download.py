"""`moedesk download` against a fake Hub on 127.0.0.1, with the real huggingface_hub client doing the HTTP."""
from __future__ import annotations

import argparse
import errno
import io
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from moedesk.app import download as dl
from moedesk.app.download import DownloadCancelled, DownloadError, check_fits, download, gguf_quant, list_repo_files_with_sizes
from moedesk.engine.errors import MoedeskError
from tests.fake_hub import FakeHub, point_client_at

pytestmark = pytest.mark.timeout(30)

REPO_ROOT = Path(__file__).resolve().parents[2]
CHUNK = 16 * 1024  # huggingface_hub reads 10 MB at a time; small chunks let a few-hundred-KB file arrive in pieces


def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


TINY = {  # a MoE repo with a safetensors checkpoint and GGUF quantisations, as Hub repos often are
    "config.json": b'{"model_type": "qwen3_moe", "num_experts": 4}',
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b'{"eos_token": "</s>"}',
    "model.safetensors.index.json": b'{"weight_map": {}}',
    "model-00001-of-00002.safetensors": blob(1, 300_000),
    "model-00002-of-00002.safetensors": blob(2, 200_000),
    "README.md": b"# tiny\n",
    ".gitattributes": b"*.safetensors filter=lfs\n",
    "original/params.json": b"{}",  # a sub-folder's files are not part of the safetensors choice
    "tiny-Q4_K_M.gguf": blob(3, 120_000),
    "tiny-Q8_0-00001-of-00002.gguf": blob(4, 100_000),
    "tiny-Q8_0-00002-of-00002.gguf": blob(5, 90_000),
    "mmproj-F16.gguf": blob(6, 30_000),
}
SAFETENSORS = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
               "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
GGUF_ONLY = {"README.md": b"# quants\n", "m-Q4_K_M.gguf": blob(7, 60_000), "m-Q6_K.gguf": blob(8, 80_000)}
ONE_GGUF = {"m-IQ4_XS.gguf": blob(9, 50_000)}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running fake Hub with the repos above, and huggingface_hub pointed at it with an empty cache in tmp_path.

    huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_CACHE once, when it is imported, so setting the
    environment here would be too late for this process: the constants it computed are patched instead (the
    subprocess test below covers the environment route that `moedesk download` users take).
    """
    from huggingface_hub.utils import close_session

    fake = FakeHub()
    fake.add_repo("moe/tiny", TINY)
    fake.add_repo("moe/gguf-only", GGUF_ONLY)
    fake.add_repo("moe/one-gguf", ONE_GGUF)
    fake.add_repo("moe/gated", {"config.json": b"{}", "model.safetensors": blob(10, 20_000)}, gated=True)
    fake.start()
    home = tmp_path / "hf-home"
    point_client_at(fake, monkeypatch, home, home / "hub", CHUNK)
    yield fake
    fake.stop()
    close_session()  # drop pooled keep-alive connections to this server


def cache_repo(repo_id: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))


def partials(repo_id: str) -> list[Path]:
    return sorted((cache_repo(repo_id) / "blobs").glob("*.incomplete"))


def blob_path(hub: FakeHub, repo_id: str, path: str) -> Path:
    return cache_repo(repo_id) / "blobs" / hub.repos[repo_id].sha256(path)


def assert_one_line(error: BaseException, *phrases: str) -> None:
    message = str(error)
    assert "\n" not in message and message.strip() == message and message
    for phrase in phrases:
        assert phrase in message


# -- listing and grouping --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, quant", [
    ("tiny-Q4_K_M.gguf", "Q4_K_M"),
    ("Qwen3-30B-A3B-Q8_0-00001-of-00003.gguf", "Q8_0"),
    ("Q4_K_M/Qwen3-30B-A3B-Q4_K_M-00002-of-00002.gguf", "Q4_K_M"),
    ("Qwen3-30B-A3B-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"),
    ("model.IQ4_XS.gguf", "IQ4_XS"),
    ("olmoe-1b-7b-bf16.gguf", "bf16"),
    ("gpt-oss-20b-MXFP4.gguf", "MXFP4"),
    ("weights.gguf", "weights"),  # no quantisation in the name: the file is its own choice
])
def test_gguf_quant_from_file_name(name, quant):
    assert gguf_quant(name) == quant


def test_listing_groups_safetensors_and_each_gguf_quantisation(hub):
    listing = list_repo_files_with_sizes("moe/tiny")

    assert listing.commit == hub.repos["moe/tiny"].commit and not listing.gated
    assert {f.path: f.size for f in listing.files} == {p: len(d) for p, d in TINY.items()}
    assert [c.name for c in listing.choices] == ["safetensors", "Q4_K_M", "Q8_0"]  # GGUF smallest first

    safetensors, q4, q8 = listing.choices
    assert list(safetensors.files) == SAFETENSORS  # top level only: no README, no original/, no GGUF
    assert safetensors.total_bytes == sum(len(TINY[p]) for p in SAFETENSORS)
    assert q4.files == ("tiny-Q4_K_M.gguf",) and q4.total_bytes == 120_000
    assert q8.files == ("tiny-Q8_0-00001-of-00002.gguf", "tiny-Q8_0-00002-of-00002.gguf")
    assert q8.total_bytes == 190_000
    assert all("mmproj" not in p for c in listing.choices for p in c.files)  # vision projector, not a quant
    for choice in listing.choices:  # each choice's --include globs pick exactly its files
        assert sorted(f.path for f in listing.select(choice.include)) == sorted(choice.files)
    assert q8.include == ("*Q8_0*.gguf",)  # short enough to type
    assert listing.default_choice() is safetensors
    assert q8.description == "GGUF Q8_0 (2 files, 190.0 KB)"


def test_mistral_consolidated_copy_is_left_out():
    from moedesk.app.download import RepoFile, group_choices

    files = [RepoFile(p, 10) for p in ("config.json", "params.json", "model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors", "consolidated.safetensors")]
    [choice] = group_choices(files)
    assert "consolidated.safetensors" not in choice.files and len(choice.files) == 4
    assert choice.include == ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                              "params.json")  # no short glob is exact here: the file names themselves


def test_default_choice_without_safetensors(hub):
    assert list_repo_files_with_sizes("moe/one-gguf").default_choice().name == "IQ4_XS"
    several = list_repo_files_with_sizes("moe/gguf-only")
    assert several.default_choice() is None  # a person must pick
    assert [c.name for c in several.choices] == ["Q4_K_M", "Q6_K"]


# -- fit report ------------------------------------------------------------------------------------------------

def test_fit_report(tmp_path, monkeypatch):
    import torch

    report = check_fits(10 * 1000**2, tmp_path / "not" / "made" / "yet")  # measured on the nearest existing parent
    assert report.fits_on_disk == (report.free_disk_bytes >= 10 * 1000**2 + report.margin_bytes)
    assert report.ram_total_bytes >= report.ram_available_bytes > 0
    if not torch.cuda.is_available():
        assert report.vram_total_bytes is None and "no CUDA GPU" in report.summary
    assert "\n" not in report.summary and "10.0 MB to download" in report.summary

    monkeypatch.setattr(dl.shutil, "disk_usage", lambda path: _Usage(free=5 * 10**9))
    tight = check_fits(4_500_000_000, tmp_path)
    assert not tight.fits_on_disk and "NOT enough" in tight.summary  # 4.5 GB + 1 GB margin > 5 GB
    assert check_fits(3_000_000_000, tmp_path).fits_on_disk
    assert not check_fits(10**15, tmp_path).fits_in_memory


class _Usage:
    def __init__(self, free: int):
        self.total, self.used, self.free = free * 2, free, free


# -- downloading -----------------------------------------------------------------------------------------------

def test_download_choice_byte_exact_into_the_hf_cache(hub):
    from huggingface_hub import snapshot_download

    listing = list_repo_files_with_sizes("moe/tiny")
    choice = listing.choice("safetensors")
    seen = []
    path = download("moe/tiny", include=list(choice.include), progress=lambda done, total: seen.append((done, total)))

    assert path == cache_repo("moe/tiny") / "snapshots" / listing.commit
    assert sorted(p.name for p in path.iterdir()) == sorted(SAFETENSORS)
    for name in SAFETENSORS:
        assert (path / name).read_bytes() == TINY[name]
    assert (path / SHARD1).is_symlink()  # huggingface_hub's layout: snapshot entries link to blobs/<etag>
    assert not partials("moe/tiny")
    # Progress in bytes across files: starts at 0, never goes back, ends at the total.
    total = choice.total_bytes
    assert seen[0] == (0, total) and seen[-1] == (total, total) and len(seen) > 2 * len(SAFETENSORS)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    # What `--model moe/tiny` does to find it:
    assert Path(snapshot_download("moe/tiny", local_files_only=True)) == path


def test_second_download_fetches_nothing(hub):
    download("moe/tiny", include=["*Q8_0*"])
    before = len(hub.requests)
    path = download("moe/tiny", include=["*Q8_0*"])
    new = hub.requests[before:]
    assert [(r.method, r.path) for r in new] == [("GET", "/api/models/moe/tiny")]  # just the listing
    assert (path / "tiny-Q8_0-00002-of-00002.gguf").read_bytes() == TINY["tiny-Q8_0-00002-of-00002.gguf"]


def test_connection_cut_mid_file_resumes_with_a_range_request(hub):
    hub.cut_once("moe/tiny", SHARD1, after=100_000)
    path = download("moe/tiny", include=[SHARD1])

    gets = hub.gets("moe/tiny", SHARD1)
    assert len(gets) == 2 and gets[0].range is None
    # huggingface_hub's http_get retried by itself from the last whole chunk it had received.
    assert gets[1].range == f"bytes={(100_000 // CHUNK) * CHUNK}-"
    assert (path / SHARD1).read_bytes() == TINY[SHARD1]


def test_cancel_keeps_the_partial_file_and_the_next_call_resumes_it(hub):
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    include = SAFETENSORS
    cancel = threading.Event()
    total = sum(len(TINY[p]) for p in SAFETENSORS)

    def progress(done, _total):
        if done >= total - 150_000:  # half-way through the largest file, which comes last
            cancel.set()

    with pytest.raises(DownloadCancelled) as excinfo:
        download("moe/tiny", include=include, progress=progress, cancel=cancel)
    assert_one_line(excinfo.value, "resume")

    [partial] = partials("moe/tiny")
    assert partial.name == f"{hub.repos['moe/tiny'].sha256(SHARD1)}.incomplete"
    kept = partial.stat().st_size
    assert 0 < kept < len(TINY[SHARD1]) and partial.read_bytes() == TINY[SHARD1][:kept]
    # The branch is only pointed at the snapshot once it is complete: `--model` must not load half a model.
    with pytest.raises(LocalEntryNotFoundError):
        snapshot_download("moe/tiny", local_files_only=True)

    before = {name: len(hub.gets("moe/tiny", name)) for name in SAFETENSORS}
    seen = []
    path = download("moe/tiny", include=include, progress=lambda done, total: seen.append(done))

    assert hub.gets("moe/tiny", SHARD1)[-1].range == f"bytes={kept}-"
    for name in SAFETENSORS:
        if name != SHARD1:
            assert len(hub.gets("moe/tiny", name)) == before[name]  # finished files are not fetched again
        assert (path / name).read_bytes() == TINY[name]
    assert seen[0] == total - len(TINY[SHARD1]) + kept  # progress starts from what is on disk
    assert not partials("moe/tiny")
    assert Path(snapshot_download("moe/tiny", local_files_only=True)) == path


def test_partial_file_left_by_a_crash_is_resumed_and_checked(hub):
    partial = blob_path(hub, "moe/tiny", SHARD2).with_suffix(".incomplete")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(TINY[SHARD2][:50_000])

    path = download("moe/tiny", include=[SHARD2])
    assert hub.gets("moe/tiny", SHARD2)[-1].range == "bytes=50000-"
    assert (path / SHARD2).read_bytes() == TINY[SHARD2]


def test_corrupt_partial_file_is_dropped_with_one_line(hub):
    partial = blob_path(hub, "moe/tiny", SHARD2).with_suffix(".incomplete")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"\0" * 50_000)  # not what the file starts with

    with pytest.raises(DownloadError) as excinfo:
        download("moe/tiny", include=[SHARD2])
    assert_one_line(excinfo.value, SHARD2, "checksum", "run the download again")
    assert not partial.exists()
    assert (download("moe/tiny", include=[SHARD2]) / SHARD2).read_bytes() == TINY[SHARD2]


# -- errors: one line each -------------------------------------------------------------------------------------

def test_unknown_repo(hub):
    for call in (lambda: list_repo_files_with_sizes("moe/nope"), lambda: download("moe/nope")):
        with pytest.raises(DownloadError) as excinfo:
            call()
        assert_one_line(excinfo.value, "moe/nope", "no such model")
        assert isinstance(excinfo.value, MoedeskError)


def test_invalid_repo_id(hub):
    with pytest.raises(DownloadError) as excinfo:
        download("not/a/repo")
    assert_one_line(excinfo.value, "'not/a/repo' is not a Hub repo id", "OWNER/NAME")


def test_gated_repo(hub):
    listing = list_repo_files_with_sizes("moe/gated")  # its file list is public, as on the Hub
    assert listing.gated
    with pytest.raises(DownloadError) as excinfo:
        download("moe/gated")
    assert_one_line(excinfo.value, "gated", "accept its licence", f"{hub.endpoint}/moe/gated", "hf auth login")


def test_unknown_revision(hub):
    with pytest.raises(DownloadError) as excinfo:
        download("moe/tiny", revision="v9")
    assert_one_line(excinfo.value, "no revision 'v9'")


def test_no_network(hub, monkeypatch):
    import socket

    from huggingface_hub import constants

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    with pytest.raises(DownloadError) as excinfo:
        download("moe/tiny")
    assert_one_line(excinfo.value, f"cannot reach {dead}", "network")


def test_nothing_matches_include(hub):
    with pytest.raises(DownloadError) as excinfo:
        download("moe/tiny", include=["*.bin"])
    assert_one_line(excinfo.value, "no file matches --include *.bin", "config.json")


def test_not_enough_disk_is_caught_before_downloading(hub, monkeypatch):
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda path: _Usage(free=100_000))
    with pytest.raises(DownloadError) as excinfo:
        download("moe/tiny", include=["*.safetensors"])
    assert_one_line(excinfo.value, "not enough disk space", "500.0 KB still to download")
    assert not any(r.method == "GET" and "/resolve/" in r.path or r.server == "cdn" for r in hub.requests)


def test_disk_filling_up_while_writing(hub, monkeypatch):
    def full_disk(url, temp_file, **kwargs):
        temp_file.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dl, "http_get", full_disk)
    with pytest.raises(DownloadError) as excinfo:
        download("moe/tiny", include=[SHARD1])
    assert_one_line(excinfo.value, "disk full", "run again to resume")
    assert [p.stat().st_size for p in partials("moe/tiny")] == [1000]  # kept for the next call


# -- the command line ------------------------------------------------------------------------------------------

def run_cli(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="moedesk download")
    dl.add_download_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = dl.run_download_command(parser.parse_args(argv), stderr=err, stdout=out)
    return code, out.getvalue(), err.getvalue()


def test_cli_downloads_the_safetensors_checkpoint_by_default(hub):
    code, out, err = run_cli("moe/tiny")
    assert code == 0, err
    snapshot = Path(out.strip())
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(SAFETENSORS)
    assert "moe/tiny @ " + hub.repos["moe/tiny"].commit[:12] + ": safetensors checkpoint (6 files, 500.1 KB)" in err
    assert "to download; disk:" in err and "RAM:" in err
    assert "moedesk --model moe/tiny" in err


def test_cli_include_globs_accumulate(hub):
    code, out, err = run_cli("moe/tiny", "--include", "*Q8_0*", "--include", "config.json", "README.md")
    assert code == 0, err
    assert sorted(p.name for p in Path(out.strip()).iterdir()) == \
        ["README.md", "config.json", "tiny-Q8_0-00001-of-00002.gguf", "tiny-Q8_0-00002-of-00002.gguf"]
    assert "4 files matching --include" in err


def test_cli_asks_which_gguf_quantisation(hub):
    code, out, err = run_cli("moe/gguf-only")
    assert code == 2 and out == ""
    assert "has 2 GGUF quantisations; pick one with --include" in err
    assert "moedesk download moe/gguf-only --include '*Q6_K*.gguf'" in err
    assert not partials("moe/gguf-only") and not cache_repo("moe/gguf-only").exists()

    code, out, err = run_cli("moe/gguf-only", "--include", "*Q6_K*.gguf")  # as suggested
    assert code == 0, err
    assert [p.name for p in Path(out.strip()).iterdir()] == ["m-Q6_K.gguf"]


def test_cli_single_gguf_is_the_default_and_prints_its_path(hub):
    code, out, err = run_cli("moe/one-gguf")
    assert code == 0, err
    assert out.strip().endswith("/m-IQ4_XS.gguf") and Path(out.strip()).read_bytes() == ONE_GGUF["m-IQ4_XS.gguf"]
    assert f"moedesk --model {out.strip()}" in err


def test_cli_failure_is_one_line_and_exit_1(hub):
    code, out, err = run_cli("moe/nope")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("moedesk: moe/nope: no such model")


def test_cli_ctrl_c_keeps_partial_files_and_rerun_resumes(hub, monkeypatch):
    real_http_get = dl.http_get

    def interrupted(url, temp_file, **kwargs):
        temp_file.write(TINY[kwargs["displayed_filename"]][:40_000])
        raise KeyboardInterrupt

    monkeypatch.setattr(dl, "http_get", interrupted)
    code, out, err = run_cli("moe/tiny", "--include", SHARD2)
    assert code == 130 and out == ""
    assert "interrupted" in err and "run the same command again to resume" in err
    assert [p.stat().st_size for p in partials("moe/tiny")] == [40_000]

    monkeypatch.setattr(dl, "http_get", real_http_get)
    code, out, err = run_cli("moe/tiny", "--include", SHARD2)
    assert code == 0, err
    assert hub.gets("moe/tiny", SHARD2)[-1].range == "bytes=40000-"
    assert (Path(out.strip()) / SHARD2).read_bytes() == TINY[SHARD2]


def test_cli_in_a_fresh_process_configured_by_environment(hub, tmp_path):
    """The way users run it: huggingface_hub reads HF_ENDPOINT / HF_HOME / HF_HUB_CACHE when it is imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "home"), HF_HUB_CACHE=str(tmp_path / "cache"),
               HF_HUB_DISABLE_XET="1", PYTHONPATH=str(REPO_ROOT))
    script = ("import argparse, sys; from app import download as dl; p = argparse.ArgumentParser(); "
              "dl.add_download_arguments(p); sys.exit(dl.run_download_command(p.parse_args(sys.argv[1:])))")
    result = subprocess.run([sys.executable, "-c", script, "moe/tiny", "--include", "*Q4_K_M*"], env=env,
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=25)
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path.is_relative_to(tmp_path / "cache")
    assert (path / "tiny-Q4_K_M.gguf").read_bytes() == TINY["tiny-Q4_K_M.gguf"]


def test_token_goes_to_the_hub_but_not_to_the_cdn(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_tests")
    download("moe/tiny", include=[SHARD2])
    assert all(r.headers.get("authorization") == "Bearer hf_fake_token_for_tests"
               for r in hub.requests if r.server == "hub" and "/resolve/" in r.path)
    cdn = [r for r in hub.requests if r.server == "cdn"]
    assert cdn and all("authorization" not in r.headers for r in cdn)  # httpx drops it on the cross-origin redirect

    with pytest.raises(DownloadError) as excinfo:  # logged in, licence not accepted: 403 GatedRepo
        download("moe/gated")
    assert_one_line(excinfo.value, "gated", "accept its licence")


@pytest.fixture
def split_repo(hub, tmp_path):
    """moe/split-gguf: one quantisation, a real tiny GGUF split in 3 parts in a sub-folder, as large releases are."""
    from tests.gguf_split import split_gguf
    from tests.load.test_gguf_checkpoint import write_tiny_mixtral

    write_tiny_mixtral(tmp_path / "tiny.gguf")
    parts = split_gguf(tmp_path / "tiny.gguf", tmp_path / "parts" / "tiny-Q8_0.gguf", 3)
    files = {f"Q8_0/{p.name}": p.read_bytes() for p in parts}
    hub.add_repo("moe/split-gguf", {"README.md": b"# split\n", **files})
    return tmp_path / "tiny.gguf", files


def test_cli_downloads_every_part_of_a_split_gguf_resuming_and_lists_one_model(hub, split_repo):
    from moedesk.app.models_command import listed
    from moedesk.app.tui.catalog import scan_hf_cache
    from moedesk.engine.load.checkpoint import open_checkpoint
    from moedesk.engine.load.size_estimate import summarize_path

    single, files = split_repo
    names = sorted(files)
    listing = list_repo_files_with_sizes("moe/split-gguf")
    [choice] = [c for c in listing.choices if c.kind == "gguf"]
    assert choice.files == tuple(names) and choice.total_bytes == sum(map(len, files.values()))
    assert dl.read_choice_weights(listing, choice).estimate() == summarize_path(single).estimate()

    hub.cut_once("moe/split-gguf", names[1], after=len(files[names[1]]) // 2)
    code, out, err = run_cli("moe/split-gguf")
    assert code == 0, err
    first = Path(out.strip())
    assert first.name == "tiny-Q8_0-00001-of-00003.gguf" and f"moedesk --model {first}" in err
    for name in names:
        assert (first.parent.parent / name).read_bytes() == files[name]
    assert len(hub.gets("moe/split-gguf", names[1])) == 2 and hub.gets("moe/split-gguf", names[1])[1].range

    [model] = [m for m in scan_hf_cache() if m.name.startswith("moe/split-gguf")]  # one model, not three parts
    assert model.name == "moe/split-gguf/Q8_0/tiny-Q8_0-00001-of-00003.gguf"
    assert model.size_bytes == sum(map(len, files.values()))
    assert listed(model).name == "moe/split-gguf" and listed(model).format == "GGUF Q8_0"  # what rm and --model take
    assert open_checkpoint("moe/split-gguf").parts == tuple(first.parent / Path(n).name for n in names)
