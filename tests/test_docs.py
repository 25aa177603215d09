"""The repository explains itself: a short README, docs that live in it, links that resolve, one package name,
and no modules that import each other in a circle."""
from __future__ import annotations

import ast
import functools
import io
import re
import shutil
import subprocess
import sys
import tokenize
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 350


def layers() -> tuple[str, ...]:
    """setup.py's LAYERS: the top-level folders installed as moedesk's subpackages."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LAYERS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no LAYERS")


def test_the_readme_is_a_guide_not_a_notebook():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the history goes to docs/measurements.md"


# A document outside the repository, as the code used to cite it: the design note, or the folder beside the checkout.
OUTSIDE = re.compile(r"\bDESIGN\b|\.\./shared\b")


def test_nothing_cites_a_document_outside_the_repository():
    folders = [ROOT / name for name in (*layers(), "moedesk", "tests", "docs", ".ci")]
    files = [README, ROOT / "setup.py", ROOT / "pyproject.toml"]
    files += [p for folder in folders if folder.is_dir() for p in folder.rglob("*")
              if p.suffix in {".py", ".md", ".sh", ".c", ".h", ".toml", ".txt", ".tcss", ""} and p.is_file()
              and "__pycache__" not in p.parts]
    this = Path(__file__).resolve()
    cited = [f"{p.relative_to(ROOT)}:{i}" for p in files if p.resolve() != this
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not cited, f"cite a section of docs/ instead: {cited}"


def test_the_outside_pattern_catches_what_it_should():
    assert OUTSIDE.search("The contract (DESIGN.md, \"Contracts\")") and OUTSIDE.search("# DESIGN's example")
    assert OUTSIDE.search("SRC from ../shared/tools/llamacpp") and not OUTSIDE.search("the design of the kernel")


# A measured speed in prose: tokens or bytes a second, or "N times" another way ("2.3x float32's", "3x faster"), or a
# timing read off a trace ("0.035 ms of kernels": a decimal of milliseconds).
FIGURE = re.compile(r"(?i)\d\s*(?:tok(?:en)?s?/s|[kMGT]i?B/s)\b|\d\s*(?:%|[x×])\s*(?:faster|slower)\b"
                    r"|\b\d+(?:\.\d+)?[x×](?=[\s,;:.)]|$)"  # "2 x L weights" is arithmetic, "2x" a ratio
                    r"|\d\.\d+\s*ms\b")


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line in a Python file: where a figure would be a claim."""
    source = path.read_text()
    found = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return found


def test_the_figure_pattern_catches_what_it_should():
    for claim in ("decoded 101 tok/s", "read at 88-90 GB/s", "about 2.3x float32's speed", "took ~5x its replay",
                  "1.01x plain", "3% faster", "2 x faster", "1.2 TB/s", "a 12 tokens/s run",
                  "computed in 0.035 ms of kernels", "0.66ms each"):
        assert FIGURE.search(claim), claim
    for plain in ("0.1 x the cross-entropy", "units of 2 x L weights", "'<rate> tok/s'", "8x7B", "0x1f", "4x4 tiles", "at most 1.2 batched steps",
                  "{tokens: ms}", "the step's ms", "(default 20 ms)",
                  "a 64-row tile", "top-8 of 128 experts"):
        assert not FIGURE.search(plain), plain


def test_code_comments_hold_no_measured_speeds():
    """Measured speeds live in docs/measurements.md (with their source); a comment keeps the why and cites the
    section by name."""
    found = [f"{path.relative_to(ROOT)}:{line}: {text.strip()[:80]}"
             for folder in (*layers(), "moedesk") for path in sorted((ROOT / folder).rglob("*.py"))
             for line, text in prose(path) if FIGURE.search(text)]
    assert not found, "move these figures to docs/measurements.md:\n" + "\n".join(found)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # a "# comment" in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)}


def test_slugs_are_githubs():
    assert slug("A model larger than the GPU") == "a-model-larger-than-the-gpu"
    assert slug("`moedesk serve`: the OpenAI-compatible server") == "moedesk-serve-the-openai-compatible-server"
    assert slug("The install (2026-11-28)") == "the-install-2026-11-28"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (doc.parent / path).resolve() if path else doc
        if not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(target)
    assert not broken, f"{doc.name}: links that lead nowhere: {broken}"


def test_every_doc_is_reachable_from_the_readme():
    """No orphan pages: following relative links from README.md reaches every docs/*.md."""
    seen, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for target in LINK.findall(page.read_text()):
            path = target.partition("#")[0]
            if path.endswith(".md") and not re.match(r"[a-z][a-z0-9+.-]*:", path):
                linked = (page.parent / path).resolve()
                if linked.is_file():
                    todo.append(linked)
    orphans = [doc.name for doc in DOCS if doc.resolve() not in seen]
    assert not orphans, f"no link from README.md leads to {orphans}"


def test_the_docs_the_readme_promises_exist():
    for name in ("architecture", "serve", "benchmarks", "measurements"):
        assert (ROOT / "docs" / f"{name}.md").is_file()
        assert f"docs/{name}.md" in README.read_text()


def environment_variables() -> set[str]:
    """Every MOEDESK_* name the product's code spells out as a string: the variables it reads."""
    names = set()
    for folder in (*layers(), "moedesk"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and re.fullmatch(r"MOEDESK_[A-Z0-9_]+", node.value):
                    names.add(node.value)
    return names


def test_every_environment_variable_is_in_the_architecture_guide():
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("## Environment variables"):]
    names = environment_variables()
    assert {"MOEDESK_CACHE_DIR", "MOEDESK_QUANT_PATH", "MOEDESK_API_KEY"} <= names  # the scan finds what is there
    missing = sorted(name for name in names if f"`{name}" not in table)
    assert not missing, f"docs/architecture.md, \"Environment variables\", does not name {missing}"


# ---- import circles ----------------------------------------------------------------------------------------------

def module_files() -> dict[str, Path]:
    """moedesk's modules by their installed name (moedesk.engine.runtime), from the layer folders and moedesk/."""
    modules = {}
    for folder, prefix in [("moedesk", "moedesk"), *((layer, f"moedesk.{layer}") for layer in layers())]:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((prefix, *parts))] = path
    return modules


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The moedesk modules `name` imports anywhere in its file (a function's lazy import too: a circle broken by
    deferring one side is still a circle), but for imports only a type checker runs."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(node):
        if _type_checking_only(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)  # `from pkg import module` or `from module import name`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in modules and m != name}


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def strongconnect(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1
                    stack.append(child); on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop(); on_stack.discard(member); component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)
    return found


def test_circles_finds_components_not_only_pairs():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set(), "g": {"g"}}
    assert sorted(map(sorted, circles(graph))) == [["a", "b", "c"], ["d", "e"]]


def test_imports_are_read_as_the_interpreter_resolves_them():
    graph = import_graph()
    assert "moedesk.engine.runtime" in graph["moedesk.app.cli"]  # imported inside a function
    assert "moedesk.engine.errors" in graph["moedesk.app.cli"]  # `from moedesk.engine.errors import MoedeskError`
    assert "moedesk.kernels.expert_weights" in graph["moedesk.kernels.experts"]
    assert not any(m.startswith("moedesk.app") for m in graph["moedesk.engine.runtime"])


def test_no_modules_import_each_other_in_a_circle():
    found = [sorted(c) for c in circles(import_graph())]
    assert not found, f"modules that import each other in a circle: {found}"


def test_the_layers_import_one_way():
    """app -> bench and training -> engine -> kernels: no module imports a layer above its own."""
    rank = {"moedesk.app": 3, "moedesk.bench": 2, "moedesk.training": 2, "moedesk.engine": 1, "moedesk.kernels": 0}

    def layer(module):
        return rank.get(".".join(module.split(".")[:2]))

    backwards = [(a, b) for a, deps in import_graph().items() for b in deps
                 if layer(a) is not None and layer(b) is not None and layer(b) > layer(a)]
    assert not backwards, backwards


# ---- the installed package ---------------------------------------------------------------------------------------

def test_a_wheel_installs_one_top_level_package(tmp_path):
    """`pip wheel .` from the checkout (copied, so the build's own files stay out of it) holds `moedesk` and its
    metadata, nothing else at the top: no `app`, `engine` or `kernels` that another package's would collide with."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".llamacpp", ".whl"))
    wheels = tmp_path / "wheels"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(wheels)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = wheels.glob("moedesk-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"moedesk"}, top
    for needed in ("moedesk/__init__.py", "moedesk/__main__.py", "moedesk/engine/runtime.py", "moedesk/app/cli.py",
                   "moedesk/kernels/cpu_experts.c", "moedesk/assets/calibration.txt"):
        assert needed in names, needed


# ---- the version -------------------------------------------------------------------------------------------------

def test_moedesk_version_prints_the_package_version(capsys):
    import moedesk
    from moedesk.app.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"moedesk {moedesk.__version__}"


def test_python_m_moedesk_is_the_command_exit_status_included(tmp_path):
    """`python -m moedesk` runs the CLI and exits with its status (it used to exit 0 whatever main returned)."""
    version = subprocess.run([sys.executable, "-m", "moedesk", "--version"], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("moedesk "), version.stderr
    missing = subprocess.run([sys.executable, "-m", "moedesk", "batch", str(tmp_path / "none.jsonl"), "-o",
                              str(tmp_path / "out.jsonl")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr.strip().count("\n") == 0 and "none.jsonl" in missing.stderr
