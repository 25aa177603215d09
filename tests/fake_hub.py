"""A tiny stand-in for the Hugging Face Hub on 127.0.0.1, good enough for the real `huggingface_hub` client.

It answers what huggingface_hub 2.4.0 asks when it lists and downloads model files:

- `GET /api/models/{repo}` and `GET /api/models/{repo}/revision/{rev}` (`?blobs=true` adds sizes and LFS info):
  `model_info`, `repo_info` (snapshot_download's first call);
- `GET /api/models/{repo}/tree/{rev}?recursive=...`: `list_repo_tree` (snapshot_download's file list);
- `HEAD` / `GET /{repo}/resolve/{rev}/{path}`: `get_hf_file_metadata` and `hf_hub_download`. Small files are
  served in place with `ETag` (the git blob id), `X-Repo-Commit` and `Content-Length`. LFS files answer 302 to a
  second server standing in for the CDN, with `X-Linked-Etag` (their sha256), `X-Linked-Size` and `X-Repo-Commit`,
  as the real Hub does; the client stops at a redirect to another origin and reads the metadata from it.
- `GET /blob/{sha256}` on the CDN server, with `Range: bytes=N-` answered 206 + `Content-Range`; on either server a
  bounded `Range: bytes=N-M` (how a safetensors header is read without the weights) gets just those bytes.

Errors carry the `X-Error-Code` header that `hf_raise_for_status` turns into typed exceptions: `RepoNotFound`,
`RevisionNotFound`, `EntryNotFound`, and `GatedRepo` (401 without a token, 403 with one) for gated repos.

`cut_once(repo_id, path, after)` makes the next GET of that file send its headers and `after` bytes of the
body, then close the socket: the client sees the connection drop mid-file. `hold_once(repo_id, path, after)`
makes it send `after` bytes and then stall until the test sets the event it returns, so a test can act (cancel)
while a download is certainly mid-file. Every request is recorded in `requests` so tests can assert what the
client asked for (Range headers above all).

No Xet headers are ever sent, so the client always downloads over plain HTTP.
"""
from __future__ import annotations

import hashlib
import json
import re
import socket
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_THRESHOLD = 10_000  # files this large or larger are "LFS" files served through the CDN redirect


@dataclass(frozen=True)
class RecordedRequest:
    server: str  # "hub" or "cdn"
    method: str
    path: str  # without the query string
    headers: dict[str, str]

    @property
    def range(self) -> str | None:
        return self.headers.get("range")

    @property
    def bounded(self) -> bool:
        """A Range with an end: a part of the file read on purpose, not a download (which resumes with `bytes=N-`)."""
        return bool(self.range and re.fullmatch(r"bytes=\d+-\d+", self.range))


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    commit: str
    gated: bool = False
    lfs_threshold: int = LFS_THRESHOLD

    def git_oid(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def sha256(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()

    def is_lfs(self, path: str) -> bool:
        return len(self.files[path]) >= self.lfs_threshold


@dataclass
class FakeHub:
    """Start with `with FakeHub() as hub:` (or start()/stop()); `hub.endpoint` is the HF_ENDPOINT to use."""

    repos: dict[str, FakeRepo] = field(default_factory=dict)
    requests: list[RecordedRequest] = field(default_factory=list)
    _cuts: dict[tuple[str, str], int] = field(default_factory=dict)
    _holds: dict[tuple[str, str], tuple[int, threading.Event]] = field(default_factory=dict)
    _releases: list[threading.Event] = field(default_factory=list)  # every hold's, taken or not, for stop()
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add_repo(self, repo_id: str, files: dict[str, bytes], gated: bool = False) -> FakeRepo:
        digest = hashlib.sha1(repo_id.encode())
        for path, data in sorted(files.items()):
            digest.update(path.encode() + b"\0" + data)
        commit = digest.hexdigest()
        repo = FakeRepo(repo_id, dict(files), commit, gated)
        self.repos[repo_id] = repo
        return repo

    def cut_once(self, repo_id: str, path: str, after: int) -> None:
        """The next GET of this file sends `after` bytes of its body and then drops the connection."""
        with self._lock:
            self._cuts[(repo_id, path)] = after

    def hold_once(self, repo_id: str, path: str, after: int) -> threading.Event:
        """The next GET of this file sends `after` bytes of its body, then waits until the returned event is set
        (or the server stops) before sending the rest."""
        release = threading.Event()
        with self._lock:
            self._holds[(repo_id, path)] = (after, release)
            self._releases.append(release)
        return release

    def gets(self, repo_id: str, path: str, headers: bool = False) -> list[RecordedRequest]:
        """The GETs that downloaded this file (from the hub for small files, from the CDN for LFS files); with
        headers=True, those that read only a part of it (a bounded Range: a safetensors header) instead."""
        repo = self.repos[repo_id]
        if repo.is_lfs(path):
            target = ("cdn", f"/blob/{repo.sha256(path)}")
            found = [r for r in self.requests if r.method == "GET" and (r.server, r.path) == target]
        else:
            pattern = re.compile(rf"/{re.escape(repo_id)}/resolve/[^/]+/{re.escape(path)}")
            found = [r for r in self.requests if r.method == "GET" and r.server == "hub" and pattern.fullmatch(r.path)]
        return [r for r in found if r.bounded == headers]

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self, lifetime: float = 120.0) -> FakeHub:
        """Serve in background threads; the servers stop after `lifetime` seconds even if stop() is never called."""
        self._hub = _Server(self, "hub")
        self._cdn = _Server(self, "cdn")
        for server in (self._hub, self._cdn):
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self._stopped = threading.Event()
        self._timer = threading.Timer(lifetime, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        with self._lock:
            for release in self._releases:
                release.set()  # a stalled handler thread must not outlive the server
        self._timer.cancel()
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._hub.server_port}"

    @property
    def cdn_endpoint(self) -> str:
        return f"http://127.0.0.1:{self._cdn.server_port}"

    # -- request handling (called from the server threads) ---------------------------------------------------

    def _record(self, server: str, handler: BaseHTTPRequestHandler) -> None:
        headers = {k.lower(): v for k, v in handler.headers.items()}
        with self._lock:
            self.requests.append(RecordedRequest(server, handler.command, urlsplit(handler.path).path, headers))

    def _take_cut(self, repo_id: str, path: str) -> int | None:
        with self._lock:
            return self._cuts.pop((repo_id, path), None)

    def _take_hold(self, repo_id: str, path: str) -> tuple[int, threading.Event] | None:
        with self._lock:
            return self._holds.pop((repo_id, path), None)

    def _find_blob(self, sha256: str) -> tuple[FakeRepo, str] | None:
        for repo in self.repos.values():
            for path in repo.files:
                if repo.is_lfs(path) and repo.sha256(path) == sha256:
                    return repo, path
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a client's idle keep-alive connection must not keep the test process alive

    def __init__(self, hub: FakeHub, role: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hub = hub
        self.role = role

    def handle_error(self, request, client_address) -> None:
        # A client that hangs up (a cancelled download closing its connection) is normal here, not worth a traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


_API = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?")
_TREE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?")
_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")
_BLOB = re.compile(r"/blob/(?P<sha>[0-9a-f]{64})")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the real Hub: the client pools connections
    timeout = 5  # an idle keep-alive connection closes on its own, so no handler thread outlives a test for long
    server: _Server

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def _dispatch(self, head: bool) -> None:
        hub = self.server.hub
        hub._record(self.server.role, self)
        url = urlsplit(self.path)
        path = unquote(url.path)
        try:
            if self.server.role == "cdn":
                if m := _BLOB.fullmatch(path):
                    return self._cdn_blob(m["sha"], head)
            elif m := _TREE.fullmatch(path):
                return self._tree(m["repo"], unquote(m["rev"]), m["path"] or "")
            elif m := _API.fullmatch(path):
                return self._model_info(m["repo"], unquote(m["rev"] or "main"), parse_qs(url.query))
            elif m := _RESOLVE.fullmatch(path):
                return self._resolve(m["repo"], unquote(m["rev"]), m["path"], head)
            self._error(404, "EntryNotFound", "Not found")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away (a cancelled download): nothing to answer

    # -- hub -------------------------------------------------------------------------------------------------

    def _repo_at(self, repo_id: str, revision: str) -> FakeRepo | None:
        """The repo if it exists and `revision` names its only commit (by branch name or hash); else sends 404."""
        repo = self.server.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if revision not in ("main", repo.commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def _model_info(self, repo_id: str, revision: str, query: dict) -> None:
        repo = self._repo_at(repo_id, revision)
        if repo is None:
            return
        with_blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for path, data in sorted(repo.files.items()):
            sibling = {"rfilename": path}
            if with_blobs:
                sibling.update(size=len(data), blobId=repo.git_oid(path))
                if repo.is_lfs(path):
                    sibling["lfs"] = {"sha256": repo.sha256(path), "size": len(data), "pointerSize": 134}
            siblings.append(sibling)
        # Like the real Hub, a gated repo's metadata is public; only its files need an accepted licence.
        self._json({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                    "gated": "manual" if repo.gated else False, "siblings": siblings})

    def _tree(self, repo_id: str, revision: str, prefix: str) -> None:
        repo = self._repo_at(repo_id, revision)
        if repo is None:
            return
        entries = []
        for path, data in sorted(repo.files.items()):
            if prefix and not path.startswith(prefix.rstrip("/") + "/"):
                continue
            entry = {"type": "file", "path": path, "size": len(data), "oid": repo.git_oid(path)}
            if repo.is_lfs(path):
                entry["lfs"] = {"oid": repo.sha256(path), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        self._json(entries)

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        repo = self._repo_at(repo_id, revision)
        if repo is None:
            return
        if repo.gated:
            if "authorization" in {k.lower() for k in self.headers.keys()}:
                return self._error(403, "GatedRepo", "Access to this model is restricted: accept its conditions")
            return self._error(401, "GatedRepo", "Access to this model is restricted: you must be authenticated")
        if path not in repo.files:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {revision}")
        data = repo.files[path]
        if repo.is_lfs(path):
            sha = repo.sha256(path)
            self.send_response(302)
            self.send_header("Location", f"{self.server.hub.cdn_endpoint}/blob/{sha}")
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("ETag", f'"{repo.git_oid(path)}"')
            self.send_header("X-Linked-Etag", f'"{sha}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._send_bytes(repo, path, data, head, extra={"ETag": f'"{repo.git_oid(path)}"',
                                                        "X-Repo-Commit": repo.commit})

    # -- cdn -------------------------------------------------------------------------------------------------

    def _cdn_blob(self, sha: str, head: bool) -> None:
        found = self.server.hub._find_blob(sha)
        if found is None:
            return self._error(404, None, "No such blob")
        repo, path = found
        self._send_bytes(repo, path, repo.files[path], head, extra={"ETag": f'"{sha}"'})

    # -- responses -------------------------------------------------------------------------------------------

    def _send_bytes(self, repo: FakeRepo, path: str, data: bytes, head: bool, extra: dict[str, str]) -> None:
        start, end = 0, None
        if m := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")):
            start, end = int(m[1]), int(m[2]) if m[2] else None
        # As real servers answer: nothing to send at or past the end is 416, an empty file's bounded range too
        # (a resumed download of an empty file, `bytes=0-`, still gets its nothing).
        if start > len(data) or (start == len(data) and (len(data) > 0 or end is not None)):
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = data[start:] if end is None else data[start:end + 1]
        partial = start or end is not None
        self.send_response(206 if partial else 200)
        if partial:
            self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(data)}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        for key, value in extra.items():
            self.send_header(key, value)
        self.end_headers()
        if head or end is not None:  # a bounded range reads a header: cuts and holds are for downloads
            if not head:
                self.wfile.write(body)
            return
        cut = self.server.hub._take_cut(repo.repo_id, path)
        if cut is not None:
            # Headers promised len(body) bytes; send fewer and hang up, as a dropped connection does.
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        hold = self.server.hub._take_hold(repo.repo_id, path)
        if hold is not None:
            after, release = hold
            self.wfile.write(body[:after])
            self.wfile.flush()
            release.wait(timeout=60)
            self.wfile.write(body[after:])  # a client that gave up meanwhile makes this raise; _dispatch expects it
            return
        self.wfile.write(body)

    def _json(self, payload) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def point_client_at(fake: FakeHub, monkeypatch, home, hub_cache, chunk: int) -> None:
    """Point the huggingface_hub client of this process at `fake`, with its home and cache in the given folders.

    The client reads HF_ENDPOINT / HF_HOME / HF_HUB_CACHE when it is imported, so its constants are
    patched; tokens from the environment are dropped, and Xet is off (the fake serves plain HTTP).
    """
    from huggingface_hub import constants

    for name, value in {
        "ENDPOINT": fake.endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": fake.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(hub_cache),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_XET": True,
        "DOWNLOAD_CHUNK_SIZE": chunk,
    }.items():
        monkeypatch.setattr(constants, name, value)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
