"""OpenAI's Files and Batches APIs on `moedesk serve`: a client uploads a JSONL file of requests (purpose "batch"),
creates a batch over it, polls the batch, and downloads its output and error files, as the openai client's
`files` and `batches` do against OpenAI.

Each line goes through the server's one request path (Server.start): a batch shares the continuous batch with
the live clients (a line the queue has no room for waits its turn), and its lines may name any model the
server serves. The file is checked whole before any line runs (a batch with a bad line fails, naming the
lines, as OpenAI's does). Files and batches last as long as the server: the files sit in a folder of its own,
removed when it exits.
"""
from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from moedesk.app.api_errors import ApiError, error_body

ENDPOINTS = {"/v1/chat/completions": True, "/v1/completions": False}  # endpoint -> whether its lines are chats
WINDOW = "24h"  # the one completion window OpenAI offers; lines here run as soon as they can
MAX_FILE_BYTES = 200 * 2**20  # OpenAI's limits for a batch's input file
MAX_LINES = 50_000
RETRY_S = 0.25  # a line turned away by a full queue or a model being swapped is submitted again after this
RETRIED = ("queue_full", "model_busy")
LIST_LIMIT = 100
WORKERS = 8  # lines in flight while no model is loaded to size them by


def routes(server) -> list[Route]:
    api = BatchesApi(server)
    return [route for prefix in ("/v1", "") for route in (
        Route(f"{prefix}/files", api.upload, methods=["POST"]),
        Route(f"{prefix}/files", api.files, methods=["GET"]),
        Route(f"{prefix}/files/{{file_id}}", api.file, methods=["GET"]),
        Route(f"{prefix}/files/{{file_id}}", api.delete_file, methods=["DELETE"]),
        Route(f"{prefix}/files/{{file_id}}/content", api.content, methods=["GET"]),
        Route(f"{prefix}/batches", api.create, methods=["POST"]),
        Route(f"{prefix}/batches", api.batches, methods=["GET"]),
        Route(f"{prefix}/batches/{{batch_id}}", api.batch, methods=["GET"]),
        Route(f"{prefix}/batches/{{batch_id}}/cancel", api.cancel, methods=["POST"]))]


def _id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    bytes: int
    path: Path
    created_at: int = field(default_factory=lambda: int(time.time()))

    def json(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "status_details": None,
                "expires_at": None}


@dataclass
class Batch:
    id: str
    endpoint: str
    input_file_id: str
    metadata: dict | None
    status: str = "validating"  # in_progress, finalizing, completed; failed; cancelling, cancelled
    created_at: int = field(default_factory=lambda: int(time.time()))
    times: dict = field(default_factory=dict)  # in_progress_at, finalizing_at, completed_at, failed_at, ...
    total: int = 0
    completed: int = 0
    failed: int = 0
    errors: list = field(default_factory=list)  # why the file was refused: {code, message, line, param}
    output_file_id: str | None = None
    error_file_id: str | None = None
    jobs: set = field(default_factory=set)  # the lines' jobs in flight: what a cancel cuts

    def enter(self, status: str) -> None:
        self.status = status
        self.times[f"{status}_at"] = int(time.time())

    def json(self) -> dict:
        stamps = ("in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                  "cancelling_at", "cancelled_at")
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint,
                "errors": {"object": "list", "data": self.errors} if self.errors else None,
                "input_file_id": self.input_file_id, "completion_window": WINDOW, "status": self.status,
                "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, **{name: self.times.get(name) for name in stamps},
                "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
                "metadata": self.metadata}


def check_lines(raw: bytes, endpoint: str) -> tuple[list[tuple[str, dict]], list[dict]]:
    """(custom_id, body) of each line of a batch's input file, or the errors that refuse the file (one per bad line,
    its 1-based number given, at most 100): every line a JSON object with a unique custom_id, method POST, the
    batch's endpoint as url and an object as body."""
    lines, errors, seen = [], [], set()

    def bad(number: int, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < 100:
            errors.append({"code": code, "message": message, "param": param, "line": number})

    for number, text in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            bad(number, "invalid_json_line", "This line is not parseable JSON.")
            continue
        if not isinstance(obj, dict):
            bad(number, "invalid_json_line", "This line is not a JSON object.")
            continue
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            bad(number, "missing_required_parameter", "custom_id must be a non-empty string.", "custom_id")
        elif custom_id in seen:
            bad(number, "duplicate_custom_id", f"The custom_id {custom_id!r} is used more than once.", "custom_id")
        seen.add(custom_id)
        if obj.get("method", "POST") != "POST":
            bad(number, "invalid_method", "method must be POST.", "method")
        if obj.get("url") != endpoint:
            bad(number, "mismatched_endpoint", f"url must be the batch's endpoint, {endpoint}.", "url")
        if not isinstance(obj.get("body"), dict):
            bad(number, "invalid_body", "body must be a JSON object: the endpoint's request.", "body")
        lines.append((custom_id, obj.get("body")))
    if not lines and not errors:
        bad(0, "empty_file", "The input file holds no requests.")
    if len(lines) > MAX_LINES:
        bad(0, "too_many_requests", f"A batch holds at most {MAX_LINES} requests; this file has {len(lines)}.")
    return lines, errors


def output_line(custom_id: str, status: int, body: dict) -> bytes:
    """OpenAI's per-line object of a batch's output and error files."""
    record = {"id": _id("batch_req_"), "custom_id": custom_id,
              "response": {"status_code": status, "request_id": _id("req_"), "body": body}, "error": None}
    return json.dumps(record, ensure_ascii=False).encode() + b"\n"


class BatchesApi:
    def __init__(self, server):
        self.server = server
        self.stored: dict[str, StoredFile] = {}
        self.runs: dict[str, Batch] = {}
        self.tasks: set[asyncio.Task] = set()
        self._folder: tempfile.TemporaryDirectory | None = None  # made at the first upload, removed at exit

    # --- files --------------------------------------------------------------------------------------------------

    @property
    def folder(self) -> Path:
        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="moedesk-serve-files-")
        return Path(self._folder.name)

    def _keep(self, filename: str, purpose: str, path: Path) -> StoredFile:
        stored = StoredFile(path.name, filename, purpose, path.stat().st_size, path)
        self.stored[stored.id] = stored
        return stored

    async def upload(self, http: HttpRequest) -> Response:
        self.server._authorise(http)
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_FILE_BYTES + 2**20:
            raise ApiError(413, f"A file may hold at most {MAX_FILE_BYTES >> 20} MiB", "file", "file_too_large")
        try:
            form = await http.form(max_files=1, max_fields=4)
        except Exception as e:  # noqa: BLE001 -- starlette's parser says what was wrong with the form
            raise ApiError(400, f"Send the file as multipart/form-data with the fields file and purpose ({e})",
                           "file") from None
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if purpose != "batch":
                raise ApiError(400, f"purpose must be 'batch' (this server runs batches), got {purpose!r}", "purpose",
                               "invalid_value")
            if upload is None or isinstance(upload, str):
                raise ApiError(400, "The form holds no file: send it as the field 'file'", "file",
                               "missing_required_parameter")
            path = self.folder / _id("file-")
            try:
                size = await run_in_threadpool(_copy, upload.file, path, MAX_FILE_BYTES)
            except OSError as e:  # a full disk: nothing is kept
                path.unlink(missing_ok=True)
                raise ApiError(507, f"The server cannot store the file: {e.strerror or e}", "file", "storage_full",
                               kind="server_error") from None
            if size > MAX_FILE_BYTES:
                path.unlink()
                raise ApiError(413, f"A file may hold at most {MAX_FILE_BYTES >> 20} MiB", "file", "file_too_large")
            return JSONResponse(self._keep(upload.filename or path.name, purpose, path).json())
        finally:
            await form.close()

    def _find(self, http: HttpRequest, table: dict, param: str, kind: str):
        """The File or Batch the path names, once the key is checked; 404 as OpenAI's for an unknown id."""
        self.server._authorise(http)
        key = http.path_params[param]
        if key not in table:
            raise ApiError(404, f"No such {kind} object: {key}", "id", "not_found")
        return table[key]

    def _file(self, http: HttpRequest) -> StoredFile:
        return self._find(http, self.stored, "file_id", "File")

    async def files(self, http: HttpRequest) -> Response:
        self.server._authorise(http)
        purpose = http.query_params.get("purpose")
        return _page([f.json() for f in self.stored.values() if purpose in (None, f.purpose)], has_more=False)

    async def file(self, http: HttpRequest) -> Response:
        return JSONResponse(self._file(http).json())

    async def content(self, http: HttpRequest) -> Response:
        stored = self._file(http)
        return FileResponse(stored.path, media_type="application/octet-stream", filename=stored.filename)

    async def delete_file(self, http: HttpRequest) -> Response:
        stored = self._file(http)
        del self.stored[stored.id]
        stored.path.unlink(missing_ok=True)  # a batch reading it has its lines already
        return JSONResponse({"id": stored.id, "object": "file", "deleted": True})

    # --- batches ------------------------------------------------------------------------------------------------

    def _batch(self, http: HttpRequest) -> Batch:
        return self._find(http, self.runs, "batch_id", "Batch")

    async def create(self, http: HttpRequest) -> Response:
        server = self.server
        server._authorise(http)
        body = await server._json_body(http)
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "endpoint",
                           "invalid_value")
        if body.get("completion_window") != WINDOW:
            raise ApiError(400, f"completion_window must be '{WINDOW}'", "completion_window", "invalid_value")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise ApiError(400, "metadata must be an object of at most 16 string values", "metadata", "invalid_value")
        stored = self.stored.get(body.get("input_file_id"))
        if stored is None or stored.purpose != "batch":
            raise ApiError(400, f"input_file_id {body.get('input_file_id')!r} is not a file uploaded with purpose "
                                f"'batch'", "input_file_id", "invalid_value")
        if server.stopping:
            raise ApiError(503, "The server is shutting down: it takes no new batches.", code="server_shutting_down",
                           kind="server_error")
        batch = Batch(_id("batch_"), endpoint, stored.id, metadata)
        self.runs[batch.id] = batch
        raw = await run_in_threadpool(stored.path.read_bytes)
        task = asyncio.get_running_loop().create_task(self._run(batch, raw))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return JSONResponse(batch.json())

    async def batch(self, http: HttpRequest) -> Response:
        return JSONResponse(self._batch(http).json())

    async def batches(self, http: HttpRequest) -> Response:
        self.server._authorise(http)
        try:
            limit = min(max(int(http.query_params.get("limit", 20)), 1), LIST_LIMIT)
        except ValueError:
            raise ApiError(400, "limit must be an integer", "limit", "invalid_type") from None
        runs = list(reversed(self.runs.values()))  # newest first, as OpenAI lists them
        after = http.query_params.get("after")
        if after in self.runs:
            runs = runs[[b.id for b in runs].index(after) + 1:]
        return _page([b.json() for b in runs[:limit]], has_more=len(runs) > limit)

    async def cancel(self, http: HttpRequest) -> Response:
        batch = self._batch(http)
        if batch.status in ("validating", "in_progress"):
            batch.enter("cancelling")
            for job in list(batch.jobs):  # cut: their rows are freed at the next step, and the lines not written
                self.server.cut(job)
        return JSONResponse(batch.json())

    # --- one batch's run ----------------------------------------------------------------------------------------

    async def _run(self, batch: Batch, raw: bytes) -> None:
        try:
            await self._lines(batch, raw)
        except Exception as e:  # noqa: BLE001 -- a full disk, say: this batch fails with the reason, the server goes on
            batch.errors.append({"code": "batch_failed", "message": " ".join(f"{type(e).__name__}: {e}".split()),
                                 "param": None, "line": None})
            batch.enter("failed")

    async def _lines(self, batch: Batch, raw: bytes) -> None:
        lines, batch.errors = await run_in_threadpool(check_lines, raw, batch.endpoint)
        if batch.errors:
            batch.enter("failed")
            return
        batch.total = len(lines)
        if batch.status == "validating":
            batch.enter("in_progress")
        out_path, err_path = self.folder / _id("file-"), self.folder / _id("file-")
        todo = iter(lines)
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            async def worker() -> None:
                for custom_id, body in todo:
                    if batch.status == "cancelling" or self.server.stopping:
                        return
                    answer = await self._line(batch, body)
                    if answer is None:  # cut by a cancel: neither done nor failed, as OpenAI counts them
                        continue
                    status, reply = answer
                    (out if status == 200 else err).write(output_line(custom_id, status, reply))
                    batch.completed += status == 200
                    batch.failed += status != 200
            await asyncio.gather(*(worker() for _ in range(self._workers())))
        if batch.status != "cancelling":
            batch.enter("finalizing")
        for path, attr in ((out_path, "output_file_id"), (err_path, "error_file_id")):
            if path.stat().st_size:
                setattr(batch, attr, self._keep(f"{batch.id}_{attr.split('_')[0]}.jsonl", "batch_output", path).id)
            else:
                path.unlink()
        batch.enter("cancelled" if batch.status == "cancelling" else "completed")

    def _workers(self) -> int:
        """Lines in flight at once: the most a loaded model's continuous batch decodes together (before any model
        is loaded, WORKERS: a line the queue turns away waits its turn anyway)."""
        return max((e.group.limit for e in self.server.pool.entries if e.group is not None), default=WORKERS)

    async def _line(self, batch: Batch, body: dict) -> tuple[int, dict] | None:
        """One request line: (HTTP status, the response body the endpoint would have answered); None when a cancel
        cut it."""
        server, chat = self.server, ENDPOINTS[batch.endpoint]
        if body.get("stream"):
            return 400, error_body("stream is not supported in a batch", "invalid_request_error", "stream")
        while True:
            try:
                jobs = await server.start_choices(body, chat)
                break
            except ApiError as e:
                if e.code not in RETRIED or batch.status == "cancelling" or server.stopping:
                    return e.status, error_body(e.message, e.kind, e.param, e.code)
                await asyncio.sleep(RETRY_S)
        batch.jobs.update(jobs)
        try:
            dones = [await server.finish(None, job) for job in jobs]
        except ApiError as e:
            if batch.status == "cancelling":
                return None
            return e.status, error_body(e.message, e.kind, e.param, e.code)
        finally:
            for job in jobs:  # a choice failed: the others' rows freed too
                job.end()
            batch.jobs.difference_update(jobs)
        return 200, server.completions_body(jobs, dones, _id("chatcmpl-" if chat else "cmpl-"))


def _page(data: list[dict], has_more: bool) -> JSONResponse:
    return JSONResponse({"object": "list", "data": data, "has_more": has_more,
                         "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


def _copy(source, path: Path, limit: int) -> int:
    """Copy an upload to `path`, stopping once it passes `limit` bytes; returns the bytes copied."""
    size = 0
    with open(path, "wb") as out:
        while chunk := source.read(2**20):
            size += len(chunk)
            if size > limit:
                break
            out.write(chunk)
    return size
