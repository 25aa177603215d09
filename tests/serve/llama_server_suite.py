"""llama.cpp's own server tests (tools/server/tests in a llama.cpp source tree) run against `moedesk serve` on the
demo, in their external mode: one moedesk server on the port they expect, their pytest sending it requests
(tests/serve/llama_server_plugin.py adapts their harness). Nothing of theirs is copied into this repository.

    python -m tests.serve.llama_server_suite LLAMA_CPP_DIR [unit/test_FILE.py ...] [--log FILE]
    # prints each file's tally and every failure's reason (default: the files in FILES)

A llama.cpp tree: a checkout, or llama-cpp-python's source archive (`pip download llama-cpp-python --no-deps
--no-binary :all:`), whose vendor/llama.cpp is the llama.cpp its wheel bundles. docs/serve.md has the last tally.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from tests.app.serve_process import served

# Their files run here, each with what its preset starts llama-server with that `moedesk serve` has too
SECURITY_KEY = "sk-this-is-the-secret-key"  # test_security.py's preset's --api-key
FILES: dict[str, tuple[str, ...]] = {
    "unit/test_chat_completion.py": (), "unit/test_tool_call.py": (), "unit/test_completion.py": (),
    "unit/test_basic.py": (), "unit/test_compat_oai_responses.py": (), "unit/test_ignore_eos.py": (),
    "unit/test_tokenize.py": (), "unit/test_template.py": (), "unit/test_security.py": ("--api-key", SECURITY_KEY),
}
PORT = 8081  # test_tool_call.py pins its server to 8081; the others read PORT, set to the same
ROOT = Path(__file__).resolve().parents[2]


def suite_dir(source: Path) -> Path | None:
    """Their tests folder in a llama.cpp tree (or in llama-cpp-python's source tree, under vendor/llama.cpp)."""
    for base in (source, source / "vendor" / "llama.cpp"):
        if (base / "tools" / "server" / "tests" / "utils.py").is_file():
            return base / "tools" / "server" / "tests"
    return None


@contextlib.contextmanager
def moedesk_server(model: str = "demo", args: tuple[str, ...] = (), startup_s: float = 300):
    """`moedesk serve --model MODEL ARGS` on 127.0.0.1:PORT (without a key unless ARGS give one), as llama-server runs
    in their tests."""
    with served(["--model", model, "--context", "4096", *args], None, startup_s, port=PORT):
        yield


def run(source: Path, files=tuple(FILES), model: str = "demo", timeout_s: float = 3000,
        log: Path | None = None) -> dict[str, tuple[str, str]]:
    """{test id: (passed | failed | skipped, the reason's first line)} for their tests `files` (slow ones left out,
    as their CI leaves them out), a server per set of server arguments. log: where their pytest's output goes."""
    here = suite_dir(source)
    if here is None:
        raise FileNotFoundError(f"{source} holds no tools/server/tests")
    groups: dict[tuple[str, ...], list[str]] = {}
    for file in files:
        groups.setdefault(FILES.get(file, ()), []).append(file)
    results = {}
    for args, group in groups.items():
        with tempfile.TemporaryDirectory(prefix="llama-suite-") as tmp, moedesk_server(model, args):
            report = Path(tmp) / "junit.xml"
            env = {**os.environ, "DEBUG_EXTERNAL": "1", "PORT": str(PORT), "MOEDESK_SUITE_MODEL": model,
                   "PYTHONPATH": os.pathsep.join([str(here), str(ROOT), os.environ.get("PYTHONPATH", "")])}
            with open(log or os.devnull, "a") as out:
                subprocess.run([sys.executable, "-m", "pytest", *group, "-m", "not slow", "-q", "-p",
                                "tests.serve.llama_server_plugin", f"--junitxml={report}", "-o",
                                f"cache_dir={tmp}/cache", f"--basetemp={tmp}/pt", "-p", "no:randomly"], cwd=here,
                               env=env, timeout=timeout_s, stdout=out, stderr=subprocess.STDOUT)
            results.update(outcomes(report.read_text()))
    return results


def outcomes(junit_xml: str) -> dict[str, tuple[str, str]]:
    results = {}
    for case in ElementTree.fromstring(junit_xml).iter("testcase"):
        name = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        outcome, reason = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                reason = (node.get("message") or node.text or "").strip().splitlines()[0][:160] if \
                    (node.get("message") or node.text) else kind
                break
        results[name] = (outcome, reason)
    return results


def tally(results: dict[str, tuple[str, str]]) -> str:
    lines, by_file = [], {}
    for name, (outcome, _) in results.items():
        counts = by_file.setdefault(name.split("::")[0], {"passed": 0, "failed": 0, "skipped": 0})
        counts[outcome] += 1
    for file, counts in by_file.items():
        lines.append(f"{file}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    lines += [f"  {outcome.upper()} {name}: {reason}" for name, (outcome, reason) in sorted(results.items())
              if outcome != "passed"]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        sys.exit("usage: bash tests/perf/llama_server_suite.sh LLAMA_CPP_DIR [unit/test_FILE.py ...] [--log FILE]")
    argv = sys.argv[1:]
    if suite_dir(Path(argv[0])) is None:
        sys.exit(f"{argv[0]}: no llama.cpp tree with tools/server/tests there (docs/serve.md says where to get one)")
    log_to = Path(argv.pop(argv.index("--log") + 1)) if "--log" in argv else None
    argv = [a for a in argv if a != "--log"]
    found = run(Path(argv[0]), tuple(argv[1:]) or tuple(FILES), log=log_to)
    print(tally(found))
    print("PASSED " + " ".join(sorted(n for n, (o, _) in found.items() if o == "passed")))
