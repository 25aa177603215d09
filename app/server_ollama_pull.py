"""Ollama's model management on `moedesk serve`: POST /api/pull downloads a model as `moedesk pull` does (a short
name such as qwen3:30b-a3b, or OWNER/REPO[:TAG]; resumable), and DELETE /api/delete removes one as `moedesk rm
--yes` does, so that front ends made for Ollama (Open WebUI's model settings, `ollama pull`) manage models here.

A pull streams Ollama's progress lines ({"status", "digest", "total", "completed"}, one JSON object a line) and
ends with {"status": "success"}; with "stream": false only the last. The download runs on a thread of its own;
a client that goes away stops it at the next chunk, the partial file kept for the next pull. A pulled model is
then one the server's `model` field finds (app/model_registry.py), as every model of the caches is.
"""
from __future__ import annotations

import asyncio
import json
import threading

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moedesk.app.api_errors import ApiError
from moedesk.engine.errors import MoedeskError


def routes(server) -> list[Route]:
    api = PullApi(server)
    return [Route("/api/pull", api.pull, methods=["POST"]), Route("/api/delete", api.delete, methods=["DELETE"])]


class PullApi:
    def __init__(self, server):
        self.server = server

    async def _name(self, http: HttpRequest) -> tuple[str, dict]:
        self.server._authorise(http)
        body = await self.server._json_body(http)
        name = body.get("model", body.get("name"))
        if not isinstance(name, str) or not name:
            raise ApiError(400, "model is required", "model")
        return name.removesuffix(":latest"), body

    async def pull(self, http: HttpRequest) -> Response:
        from moedesk.app.pull_catalogue import resolve

        try:
            name, body = await self._name(http)
            target = resolve(name)
        except ApiError as e:
            return JSONResponse({"error": e.message}, e.status)
        except MoedeskError as e:
            return JSONResponse({"error": str(e)}, 400)
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        put = lambda item: loop.call_soon_threadsafe(updates.put_nowait, item)  # noqa: E731
        loop.run_in_executor(None, _download, target, put, cancel)

        async def lines():
            try:
                while (item := await updates.get()) is not None:
                    yield json.dumps(item).encode() + b"\n"
            finally:
                cancel.set()  # finished, or the client went away: a download still running stops at its next chunk

        if body.get("stream", True) is not False:
            return StreamingResponse(lines(), media_type="application/x-ndjson")
        last = {}
        async for line in lines():
            last = json.loads(line)
        return JSONResponse(last, 500 if "error" in last else 200)

    async def delete(self, http: HttpRequest) -> Response:
        from moedesk.app.models_command import plan_removal, remove

        try:
            name, _ = await self._name(http)
            removal = plan_removal(name)
        except ApiError as e:
            return JSONResponse({"error": e.message}, e.status)
        except MoedeskError as e:  # not in the caches: Ollama's 404
            return JSONResponse({"error": f"model '{name}' not found ({e})"}, 404)
        pool = self.server.pool
        held = [e for e in pool.entries if e.loaded and _inside(e.source, removal.paths)]
        if held:
            return JSONResponse({"error": f"model '{name}' is loaded as '{held[0].name}': it cannot be removed "
                                          f"while it serves"}, 409)
        await asyncio.to_thread(remove, removal)
        pool.entries[:] = [e for e in pool.entries if not (e.reloadable and _inside(e.source, removal.paths))]
        return Response(status_code=200)


def _download(target, put, cancel: threading.Event) -> None:
    """The pull itself, on a thread: Ollama's progress lines through `put`, then None."""
    from moedesk.app import download as dl
    from moedesk.app.pull_catalogue import pick_choice

    try:
        put({"status": "pulling manifest"})
        listing = dl.list_repo_files_with_sizes(target.repo_id)
        choice = pick_choice(listing, target.tag)
        digest = f"{listing.repo_id}@{listing.commit[:12]}:{choice.name}"
        status = f"pulling {choice.name}"
        dl.download(listing.repo_id, None, list(choice.include), cancel=cancel,
                    progress=lambda done, total: put({"status": status, "digest": digest, "total": total,
                                                      "completed": done}))
        for step in ("verifying sha256 digest", "writing manifest", "success"):
            put({"status": step})
    except dl.DownloadCancelled:
        pass  # the client left: nobody reads on
    except MoedeskError as e:  # DownloadError among them: one line, as `moedesk pull` says it
        put({"error": " ".join(str(e).split())})
    except Exception as e:  # noqa: BLE001 -- the stream ends with the reason, never a hung client
        put({"error": f"{type(e).__name__}: {' '.join(str(e).split())}"})
    finally:
        put(None)


def _inside(source, paths) -> bool:
    """Whether a served model's source (a folder, a file or a repo id) lies in one of the folders to remove."""
    text = str(source)
    return any(text == str(p) or text.startswith(str(p) + "/") or p.name.endswith("--" + text.replace("/", "--"))
               for p in paths)
