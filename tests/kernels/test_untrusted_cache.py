"""The cache folder is not trusted (issue 46, item 16): a link planted at a temporary file's name is not written
through, and a compiled kernel that is not what was built (planted, cut short) is built again, not loaded."""
import ctypes
import os

import pytest

from moedesk.engine.json_cache import cached_json
from moedesk.kernels.native_build import build_library, find_compiler


def test_a_link_planted_at_the_temporary_name_is_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("profile-key.tmp", ".profile-key.tmp"):
        (cache / name).symlink_to(victim)
    assert cached_json(cache / "profile-key.json", lambda: {"a": 1}) == {"a": 1}
    assert victim.read_text() == "precious"
    assert cached_json(cache / "profile-key.json", lambda: {"a": 2}) == {"a": 1}  # stored, and read back


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler")
def test_a_planted_or_truncated_kernel_is_built_again(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "seven.c"
    src.write_text("int seven(void) { return 7; }\n")
    library = build_library(src, ["-shared", "-fPIC"])
    good = library.read_bytes()
    library.write_bytes(good[: len(good) // 3])  # cut short: loading it could end in SIGBUS
    assert build_library(src, ["-shared", "-fPIC"]) == library and library.read_bytes() == good
    other = tmp_path / "other.c"
    other.write_text("int seven(void) { return 666; }\n")
    planted = build_library(other, ["-shared", "-fPIC"])
    os.replace(planted, library)  # another library under the expected name: its constructor would run
    assert build_library(src, ["-shared", "-fPIC"]) == library
    assert ctypes.CDLL(str(library)).seven() == 7
