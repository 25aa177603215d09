"""A GGUF choice's memory estimate read from the Hub (app.download.read_choice_weights): the file's header fetched
with bounded Range requests from tests/fake_hub.py, never its tensor data, and sized as the file on disk is."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from moedesk.app import download as dl
from moedesk.app.download import DownloadError, list_repo_files_with_sizes, read_choice_weights
from moedesk.engine.errors import MoedeskError, UnsupportedModelError
from moedesk.engine.load.gguf_header import parse_header
from moedesk.engine.load.size_estimate import summarize_path
from tests.app.test_download import assert_one_line, blob
from tests.fake_hub import FakeHub, point_client_at
from tests.load.test_gguf_header import write_moe_gguf

pytestmark = pytest.mark.timeout(60)

REPO = "moe/quants"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The GGUF files the fake repo serves, on disk: one whole, the same model split in parts, and bad ones."""
    root = tmp_path_factory.mktemp("ggufs")
    (root / "whole").mkdir(), (root / "split").mkdir(), (root / "rope").mkdir()
    [whole] = write_moe_gguf(root / "whole" / "tiny-Q4_K_M.gguf")
    parts = write_moe_gguf(root / "split" / "tiny-Q8_0.gguf", split_max_tensors=12)
    [rope] = write_moe_gguf(root / "rope" / "tiny-Q4_0.gguf", rope_freqs=np.linspace(1, 8, 32))
    return {"tiny-Q4_K_M.gguf": whole, **{p.name: p for p in parts}, "tiny-Q4_0.gguf": rope}


@pytest.fixture
def hub(files, tmp_path, monkeypatch):
    from huggingface_hub.utils import close_session

    whole = files["tiny-Q4_K_M.gguf"].read_bytes()
    header_end = parse_header(whole, "whole").header_bytes
    fake = FakeHub()
    fake.add_repo(REPO, {"README.md": b"# quants\n", **{name: path.read_bytes() for name, path in files.items()},
                         "not-a-gguf-Q2_K.gguf": blob(1, 50_000),
                         "cut-Q3_K.gguf": whole[:header_end - 100],  # the file ends inside its header
                         "tiny-IQ4_XS.gguf": b"GG",  # shorter than the magic
                         "empty-Q5_K_M.gguf": b""})  # the Hub answers a Range into it with 416
    fake.add_repo("moe/gated", {"m-Q4_K_M.gguf": whole}, gated=True)
    fake.start()
    home = tmp_path / "hf-home"
    point_client_at(fake, monkeypatch, home, home / "hub", 16 * 1024)
    yield fake
    fake.stop()
    close_session()


def ranges(hub: FakeHub, path: str) -> list[tuple[int, int]]:
    """The bounded ranges asked of one file, [start, end) each, in the order asked."""
    repo = hub.repos[REPO]
    out = []
    for request in hub.requests:
        if request.method != "GET" or not request.range:
            continue
        at_cdn = request.server == "cdn" and request.path == f"/blob/{repo.sha256(path)}"
        at_hub = request.server == "hub" and request.path.endswith(f"/resolve/{repo.commit}/{path}")
        if at_cdn or (at_hub and not repo.is_lfs(path)):
            m = re.fullmatch(r"bytes=(\d+)-(\d+)", request.range)
            assert m, f"an unbounded request for {path}: {request.range}"
            out.append((int(m[1]), int(m[2]) + 1))
    return out


def choice(name: str, repo_id: str = REPO):
    listing = list_repo_files_with_sizes(repo_id)
    return listing, listing.choice(name)


def assert_same_estimates(got, expected) -> None:
    assert got.config == expected.config and got.stored == expected.stored
    for expert_dtype in ("auto", "bf16", "int8", "int4"):
        for dtype in ("float32", "bfloat16"):
            assert got.estimate(expert_dtype, dtype) == expected.estimate(expert_dtype, dtype)


def test_the_estimate_is_the_file_s_own_from_its_header_alone(hub, files):
    path = files["tiny-Q4_K_M.gguf"]
    size, end = path.stat().st_size, parse_header(path.read_bytes(), path).header_bytes
    weights = read_choice_weights(*choice("Q4_K_M"), first_bytes=64 * 1024)
    assert_same_estimates(weights, summarize_path(path))
    assert weights.estimate("auto").experts_as == "q4_0/q4_k/q8_0/bf16"
    # One request of the first 64 KiB: the header, never the blocks behind it.
    assert ranges(hub, "tiny-Q4_K_M.gguf") == [(0, 64 * 1024)] and end < 64 * 1024 < size
    files_asked = [r for r in hub.requests if "/resolve/" in r.path or r.server == "cdn"]
    assert not any(r.method == "GET" and not r.range for r in files_asked)


def test_the_range_grows_until_the_header_parses(hub, files):
    path = files["tiny-Q4_K_M.gguf"]
    end = parse_header(path.read_bytes(), path).header_bytes
    weights = read_choice_weights(*choice("Q4_K_M"), first_bytes=1024)
    assert_same_estimates(weights, summarize_path(path))
    # 1 KiB, then each time as much again as was read: only the bytes not read yet are asked for.
    asked = ranges(hub, "tiny-Q4_K_M.gguf")
    assert asked[0] == (0, 1024) and len(asked) > 3
    assert all(b[0] == a[1] and b[1] == 2 * a[1] for a, b in zip(asked, asked[1:]))
    assert asked[-1][1] >= end > asked[-2][1]
    assert asked[-1][1] < path.stat().st_size


def test_a_split_gguf_reads_every_part_s_header(hub, files):
    parts = sorted(name for name in files if name.startswith("tiny-Q8_0"))
    listing, split = choice("Q8_0")
    assert split.files == tuple(parts) and len(parts) > 2
    weights = read_choice_weights(listing, split, first_bytes=8 * 1024)
    # The same model as the whole file: the same estimate, from the metadata of the first part and the tensors of all.
    assert_same_estimates(weights, summarize_path(files["tiny-Q4_K_M.gguf"]))
    for name in parts:
        asked = ranges(hub, name)
        assert asked and asked[0][0] == 0 and sum(b - a for a, b in asked) < files[name].stat().st_size, name


def test_rope_factors_are_fetched_and_refused_as_a_load_refuses_them(hub, files):
    """Llama 3.1-style RoPE factors in a tensor: its 128 bytes are read (as loading reads them) and refused alike."""
    path = files["tiny-Q4_0.gguf"]
    with pytest.raises(UnsupportedModelError) as local:
        summarize_path(path)
    with pytest.raises(UnsupportedModelError) as remote:
        read_choice_weights(*choice("Q4_0"), first_bytes=64 * 1024)
    assert remote.value.problem == local.value.problem and "rope_freqs" in remote.value.problem
    assert_one_line(remote.value, f"{REPO}/tiny-Q4_0.gguf: ")
    rope = next(t for t in parse_header(path.read_bytes(), path).tensors if t.name == "rope_freqs.weight")
    assert ranges(hub, "tiny-Q4_0.gguf") == [(0, 64 * 1024), (rope.data_offset, rope.data_offset + 128)]


# -- one line each ---------------------------------------------------------------------------------------------

def test_not_a_gguf(hub):
    with pytest.raises(MoedeskError) as excinfo:
        read_choice_weights(*choice("Q2_K"))
    assert_one_line(excinfo.value, f"{REPO}/not-a-gguf-Q2_K.gguf: not a GGUF file (bad magic)")
    assert ranges(hub, "not-a-gguf-Q2_K.gguf") == [(0, 50_000)]  # capped at the file's size


@pytest.mark.parametrize("name, message", [
    ("Q3_K", "cut-Q3_K.gguf: truncated GGUF file: its header runs past the file's end"),
    ("IQ4_XS", "tiny-IQ4_XS.gguf: truncated GGUF file"),
])
def test_a_file_that_ends_inside_its_header(hub, name, message):
    with pytest.raises(MoedeskError) as excinfo:
        read_choice_weights(*choice(name), first_bytes=1024)
    assert_one_line(excinfo.value, message)


def test_an_empty_file(hub):
    with pytest.raises(MoedeskError) as excinfo:
        read_choice_weights(*choice("Q5_K_M"))
    assert_one_line(excinfo.value, f"{REPO}/empty-Q5_K_M.gguf: empty file")


def test_a_header_beyond_the_cap(hub, files):
    with pytest.raises(DownloadError) as excinfo:
        read_choice_weights(*choice("Q4_K_M"), first_bytes=1024, max_bytes=4096)
    assert_one_line(excinfo.value, f"{REPO}/tiny-Q4_K_M.gguf: the GGUF header is longer than 4096 bytes")
    assert sum(b - a for a, b in ranges(hub, "tiny-Q4_K_M.gguf")) == 4096


def test_a_header_claiming_more_than_the_cap_is_refused_at_once(hub):
    """A string 100 MiB long in the metadata: past the cap as soon as its length is read (the file's size unknown)."""
    import struct

    hub.repos[REPO].files["huge-Q5_K.gguf"] = (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 5) + b"a.key"
                                               + struct.pack("<IQ", 8, 100 << 20) + bytes(5 << 20))
    listing = list_repo_files_with_sizes(REPO)
    with pytest.raises(DownloadError) as excinfo:
        dl._read_gguf_header(listing, "huge-Q5_K.gguf", None, dl.GGUF_HEADER_FIRST_BYTES, dl.GGUF_HEADER_MAX_BYTES)
    assert_one_line(excinfo.value, f"{REPO}/huge-Q5_K.gguf: the GGUF header is longer than 64 MiB")
    assert ranges(hub, "huge-Q5_K.gguf") == [(0, 4 << 20)]  # asked once


def test_gated_repo(hub):
    with pytest.raises(DownloadError) as excinfo:
        read_choice_weights(*choice("Q4_K_M", "moe/gated"))
    assert_one_line(excinfo.value, "moe/gated is a gated model")


def test_no_network(hub):
    from huggingface_hub.utils import close_session

    listing, q4 = choice("Q4_K_M")
    hub.stop()
    close_session()  # no pooled connection to a server that is gone
    with pytest.raises(DownloadError) as excinfo:
        read_choice_weights(listing, q4)
    assert_one_line(excinfo.value, "cannot reach")


def test_a_server_that_ignores_range_is_read_only_as_far_as_asked():
    """200 with the whole file instead of 206: the answer is cut where the range ends, and the range's bytes are
    still the ones returned."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    data = blob(2, 8 << 20)

    class Whole(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                for at in range(0, len(data), 64 * 1024):
                    self.wfile.write(data[at:at + 64 * 1024])
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client hung up: what it asked for had arrived

    server = ThreadingHTTPServer(("127.0.0.1", 0), Whole)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/m.gguf"
        assert dl._fetch_range(url, 1000, 5000) == data[1000:5000]
        assert dl._fetch_range(url, 300_000, 400_000) == data[300_000:400_000]
    finally:
        server.shutdown()
        server.server_close()
