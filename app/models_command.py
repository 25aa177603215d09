"""`moedesk list`, `rm`, `ps` and `pull`: the models on disk, removing one, what a server has loaded, fetching one.

Nothing here loads weights: `list` reads the headers the Models screen reads (app.tui.catalog), `pull` reads the
Hub's listing and headers for its estimate, then downloads with app.download (resuming what an earlier pull left).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from moedesk.engine.errors import MoedeskError


# ---------------------------------------------------------------------------------------------------------------
# moedesk list
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ListedModel:
    name: str  # what --model, rm and pull take
    format: str  # "safetensors", "GGUF Q4_K_M"
    size_bytes: int | None
    arch: str
    experts: str
    engine: str  # "native", "llama.cpp", or "none" (the engine setting would not load it)
    where: str  # "demo" | "folder" | "gguf" | "hf cache"
    note: str = ""
    why: str = ""  # for engine "none": the line its load would stop with (after its name)


def listed(model, requested: str = "auto") -> ListedModel:
    """A catalog.LocalModel as `moedesk list` shows it: the format from the file names, the engine from the
    architecture and the engine setting `requested` (catalog.row_engine, the Models screen's decision)."""
    from moedesk.app.download import gguf_quant
    from moedesk.app.pull_catalogue import short_name
    from moedesk.app.tui.catalog import row_engine

    gguf = model.spec.endswith(".gguf")
    quant = gguf_quant(Path(model.spec).name) if gguf else ""
    fmt = f"GGUF {quant.upper()}" if gguf else "safetensors"
    choice = row_engine(model, requested)
    name = model.spec
    if model.source == "hf cache" and gguf:
        # A quantisation pulled by short name shows that name (what --model and rm take), else the repo id (what rm
        # takes; the file is in the format column), whatever sub-folder the file is in
        repo = "/".join(model.name.split("/")[:2])
        name = short_name(repo, quant) or repo
    return ListedModel(name, fmt, model.size_bytes, model.arch, model.experts, choice.kind, model.source, model.note,
                       choice.why if choice.kind == "none" else "")


def find_listed(requested: str = "auto") -> list[ListedModel]:
    from moedesk.app.tui.catalog import find_models

    return [listed(m, requested) for m in find_models()]


def list_engine(args: argparse.Namespace) -> str:
    """The engine setting `list` decides for: --engine, else the app's setting (remote: what auto would run here)."""
    if getattr(args, "engine", None):
        return args.engine
    from moedesk.app.tui.settings import load_settings

    engine = load_settings(problems=[]).engine
    return engine if engine in ("auto", "native", "llama.cpp") else "auto"


def format_table(models: list[ListedModel]) -> str:
    from moedesk.app.tui.catalog import human_size

    rows = [("NAME", "FORMAT", "SIZE", "ARCH", "EXPERTS", "ENGINE", "FROM")]
    rows += [(m.name, m.format, human_size(m.size_bytes) if m.size_bytes is not None else m.note or "—",
              m.arch, m.experts, m.engine, m.where) for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    # Below the table, why each "none" row would not load: the line Engine.load stops with.
    stops = [f"{m.name}: {m.why}" for m in models if m.why]
    return "\n".join(table + ([""] + stops if stops else []))


def run_list(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    import json
    from dataclasses import asdict

    stdout = stdout or sys.stdout
    models = find_listed(list_engine(args))
    if args.json:
        print(json.dumps([asdict(m) for m in models], indent=1), file=stdout)
    else:
        print(format_table(models), file=stdout)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# moedesk rm
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Removal:
    what: str
    paths: tuple[Path, ...]  # each inside a cache folder
    size_bytes: int
    hf_strategy: object = None  # huggingface_hub's DeleteCacheStrategy, for a cached repo


def plan_removal(name: str) -> Removal:
    """What `rm NAME` would delete: a repo of the Hugging Face cache (all its revisions), or the demo's build in
    moedesk's cache. Raises MoedeskError (one line) for anything else: nothing outside the caches is deleted."""
    from moedesk.app.download import hf_cache_dir
    from moedesk.app.pull_catalogue import CATALOGUE, resolve

    if name == "demo":
        from moedesk.app.tui.catalog import demo_folder, folder_size

        folder = demo_folder()
        if not folder.is_dir():
            raise MoedeskError("rm demo: the demo is not built (it is built again on first use)")
        if folder.is_symlink() or not folder.resolve().is_relative_to(folder.parent.resolve()):
            raise MoedeskError(f"rm demo: {folder} leads outside moedesk's cache; not removed")
        return Removal(f"the demo's build in {folder}", (folder,), folder_size(folder))
    repo_id = name
    if "/" not in name and (name.lower() in CATALOGUE or ":" in name):
        repo_id = resolve(name).repo_id
    if repo_id.count("/") != 1:
        raise MoedeskError(f"rm {name}: not a model of the caches (`moedesk list` names them); moedesk removes only "
                           "what it or Hugging Face downloaded, never a folder of yours")
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache = hf_cache_dir()
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        info = None
    repo = next((r for r in (info.repos if info else ()) if r.repo_type == "model" and r.repo_id == repo_id), None)
    if repo is None:
        raise MoedeskError(f"rm {name}: {repo_id} is not in the Hugging Face cache ({cache})")
    strategy = info.delete_revisions(*(r.commit_hash for r in repo.revisions))
    path = Path(repo.repo_path)
    if not path.resolve().is_relative_to(cache):
        raise MoedeskError(f"rm {name}: {path} is outside the Hugging Face cache; not removed")
    return Removal(f"{repo_id} from the Hugging Face cache ({path})", (path,), repo.size_on_disk, strategy)


def remove(removal: Removal) -> None:
    if removal.hf_strategy is not None:
        removal.hf_strategy.execute()  # huggingface_hub's own deletion: blobs, snapshots, refs, then the folder
        for path in removal.paths:  # partial downloads (blobs/*.incomplete) are not revisions: left behind
            shutil.rmtree(path, ignore_errors=True)
    else:
        for path in removal.paths:
            shutil.rmtree(path)


def run_rm(args: argparse.Namespace, stdin: TextIO | None = None, stderr: TextIO | None = None) -> int:
    from moedesk.app.tui.catalog import human_size

    stdin, stderr = stdin or sys.stdin, stderr or sys.stderr
    removal = plan_removal(args.name)
    print(f"moedesk: removing {removal.what}: {human_size(removal.size_bytes)}", file=stderr, flush=True)
    if not args.yes:
        if not stdin.isatty():
            raise MoedeskError(f"rm {args.name}: not removed: confirm with --yes (no terminal to ask on)")
        print("remove it? [y/N] ", end="", file=stderr, flush=True)
        if stdin.readline().strip().lower() not in ("y", "yes"):
            print("moedesk: not removed", file=stderr)
            return 1
    remove(removal)
    print(f"moedesk: removed {human_size(removal.size_bytes)}", file=stderr)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# moedesk ps
# ---------------------------------------------------------------------------------------------------------------

DEFAULT_URL = "http://127.0.0.1:8000"  # `moedesk serve`'s default --host and --port


def loaded_models(url: str, api_key: str | None, timeout: float = 5.0) -> list[dict]:
    """What the server at `url` has loaded: Ollama's /api/ps where it answers (moedesk serve, Ollama), else the
    OpenAI /v1/models. Each: {"name", "format", "family", "context_length"} (None where the API does not say)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/")
    try:
        if httpx.URL(base).scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(base)
    except (httpx.InvalidURL, httpx.UnsupportedProtocol):
        raise MoedeskError(f"--url {url}: not an http(s) URL, e.g. {DEFAULT_URL}") from None
    try:
        with httpx.Client(timeout=timeout, headers=headers) as client:
            response = client.get(base + "/api/ps")
            if response.status_code == 404:
                response = client.get(base + "/v1/models")
            if response.status_code == 401:
                raise MoedeskError(f"the server at {url} wants an API key: --api-key KEY or MOEDESK_API_KEY")
            if response.status_code != 200:
                raise MoedeskError(f"the server at {url} answered {response.status_code} to {response.url.path}")
            body = response.json()
    except httpx.HTTPError:
        raise MoedeskError(f"no server answers at {url} (start one with `moedesk serve`)") from None
    except ValueError:
        raise MoedeskError(f"the server at {url} did not answer JSON; is it a model server?") from None
    if isinstance(body, dict) and isinstance(body.get("models"), list):  # /api/ps
        return [{"name": m.get("name"), "format": (m.get("details") or {}).get("format"),
                 "family": (m.get("details") or {}).get("family"), "context_length": m.get("context_length"),
                 "until": until(m.get("expires_at"))}
                for m in body["models"] if isinstance(m, dict)]
    if isinstance(body, dict) and isinstance(body.get("data"), list):  # /v1/models
        return [{"name": m.get("id"), "format": None, "family": None, "context_length": None, "until": None}
                for m in body["data"] if isinstance(m, dict)]
    raise MoedeskError(f"the server at {url} did not answer as a model server does")


def until(expires_at, now=None) -> str | None:
    """When a loaded model unloads, in words, from /api/ps's expires_at: "forever" (a server that never unloads
    says a year ahead, as Ollama does), "in 4 minutes", "now"; None when absent or unreadable."""
    from datetime import datetime, timezone

    try:
        when = datetime.fromisoformat(str(expires_at).replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    left = (when - (now or datetime.now(timezone.utc))).total_seconds()
    if left > 300 * 86400:
        return "forever"
    if left < 1:
        return "now"
    for unit, seconds in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if left >= seconds:
            n = int(left // seconds)
            return f"in {n} {unit}{'s' if n != 1 else ''}"
    return "now"


def run_ps(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    stdout = stdout or sys.stdout
    models = loaded_models(args.url, args.api_key or os.environ.get("MOEDESK_API_KEY") or None)
    rows = [("NAME", "FORMAT", "ARCH", "CONTEXT", "UNTIL")]
    rows += [(str(m["name"]), m["format"] or "?", m["family"] or "?",
              str(m["context_length"]) if m["context_length"] else "?", m["until"] or "?") for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows), file=stdout)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# moedesk pull
# ---------------------------------------------------------------------------------------------------------------

def memory_line(listing, choice) -> str:
    """The loaded-memory estimate the download wizard shows, for this machine and the settings' dtypes."""
    from moedesk.app import download as dl
    from moedesk.app.tui.catalog import estimate_line
    from moedesk.app.tui.load_target import load_target
    from moedesk.app.tui.settings import load_settings

    class _Settings:  # what load_target asks of an app
        settings = load_settings(problems=[])

    target = load_target(_Settings)
    try:
        weights = dl.read_choice_weights(listing, choice)
    except Exception as e:  # noqa: BLE001 -- an estimate is advice: one line says why there is none
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return f"no estimate before downloading: {lines[0] if lines else type(e).__name__}"
    estimate = weights.estimate(target.expert_dtype, target.weights_dtype, target.gpu)
    return f"once loaded: {estimate_line(estimate, target.gpu, dl.format_bytes)} ({target.describe()})"


def run_pull(args: argparse.Namespace, stderr: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """0: pulled (the --model value to stdout); 1: the download failed; 2: an unknown name or tag; 130:
    interrupted, partial files kept for the next pull."""
    from moedesk.app import download as dl
    from moedesk.app.pull_catalogue import pick_choice, resolve

    stderr, stdout = stderr or sys.stderr, stdout or sys.stdout

    def say(line: str) -> None:
        print(line, file=stderr, flush=True)

    target = resolve(args.name)  # an unknown name: MoedeskError, exit 2
    try:
        listing = dl.list_repo_files_with_sizes(target.repo_id, args.revision)
        choice = pick_choice(listing, target.tag)
        say(f"{listing.repo_id} @ {listing.commit[:12]}: {choice.description}")
        if listing.gated:
            say("gated model: the download works once its licence is accepted on the Hub and `hf auth login` is done")
        say(dl.check_fits(choice.total_bytes).summary)
        say(memory_line(listing, choice))
        snapshot = dl.download_with_bar(listing.repo_id, args.revision, list(choice.include), stderr)
    except (KeyboardInterrupt, dl.DownloadCancelled):
        say("moedesk: interrupted; the partial files are kept: pull again to resume")
        return 130
    except dl.DownloadError as e:
        say(f"moedesk: {e}")
        return 1
    ggufs = sorted(p for p in choice.files if p.endswith(".gguf"))
    spec = str(snapshot / ggufs[0]) if ggufs else (listing.repo_id if args.revision is None else str(snapshot))
    say(f"done: run it with: moedesk --model {spec}")
    print(spec, file=stdout, flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------------------------

def add_arguments(sub) -> None:
    """The four subcommands, on the `moedesk` parser's subparsers."""
    from moedesk.app.pull_catalogue import CATALOGUE

    listing = sub.add_parser("list", help="the models on disk: size, format, architecture, engine",
                             description="List the models moedesk finds: the demo, your models folder and the "
                                         "Hugging Face cache; headers only, no weights are read.")
    listing.add_argument("--json", action="store_true", help="print the list as JSON")
    listing.add_argument("--engine", choices=["auto", "native", "llama.cpp"], default=None,
                         help="the engine setting the ENGINE column is decided for; none: it would not load, and "
                              "the lines below the table say why (default: the app's engine setting)")
    rm = sub.add_parser("rm", help="remove a model from the caches",
                        description="Remove a model downloaded into the Hugging Face cache (every revision), or "
                                    "the demo's build; says what and how much first.")
    rm.add_argument("name", metavar="NAME", help="a repo id as `moedesk list` shows it, a pull name, or demo")
    rm.add_argument("--yes", action="store_true",
                    help="remove without asking (without it: asks on a terminal, refuses otherwise)")
    ps = sub.add_parser("ps", help="what a running `moedesk serve` has loaded",
                        description="Ask a running server (its /api/ps, else /v1/models) which model it serves.")
    ps.add_argument("--url", default=DEFAULT_URL, help=f"the server (default: {DEFAULT_URL})")
    ps.add_argument("--api-key", default=None, metavar="KEY",
                    help="the server's key (default: the MOEDESK_API_KEY environment variable)")
    pull = sub.add_parser("pull", help="download a popular MoE model by short name (resumable)",
                          description="Download a model by short name (" + ", ".join(CATALOGUE) + "), with a "
                                      ":TAG for another quantisation (:q8_0, :safetensors...), or a repo "
                                      "id[:TAG]; shows the disk and memory it needs first; rerun to resume.")
    pull.add_argument("name", metavar="NAME[:TAG]", help="a short name, e.g. qwen3:30b-a3b, or OWNER/REPO")
    pull.add_argument("--revision", default=None, metavar="R", help="branch, tag or commit (default: main)")


COMMANDS = {"list": run_list, "rm": run_rm, "ps": run_ps, "pull": run_pull}
