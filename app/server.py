"""`moedesk serve`: an OpenAI-compatible HTTP API whose concurrent clients share one continuous batch.

Starlette + uvicorn (no hand-written HTTP). Every request becomes one `Request` on the engine's
scheduler (engine/generation/scheduler.py): it joins the running batch at the next step and leaves when done,
or when its client goes away. Endpoints:

- GET  /v1/models, /v1/models/{id}
- POST /v1/chat/completions, /v1/completions (plain or streamed as server-sent events ending in [DONE]); each of
  these also without the /v1, as llama-server has them
- POST /v1/responses (app/server_responses.py), Anthropic's /v1/messages (app/server_anthropic.py) and Ollama's
  /api/* (app/server_ollama.py), through the same request path (Server.start, .finish, .pieces); /v1/files and
  /v1/batches (app/server_batches.py) run a JSONL file of requests through it; Ollama's /api/pull and /api/delete
  (app/server_ollama_pull.py) download and remove models as `moedesk pull` and `rm` do
- GET  /moedesk/stats (the scheduler's counters and the expert stats), GET /health (no key needed)

A request's `model` picks one of the served models (app/model_registry.py): loaded on first use, one at a time,
refused with 503 and the reason when another is busy or it does not fit the RAM.

Chat replies are parsed with engine/load/reply_format.py: a thinking model's reasoning comes back as
`reasoning_content`, tool calls as `tool_calls` (app/chat_request.py checks tools and tool_choice). CORS is off
unless --cors names origins.

Decoding: `--speculative` (with `--draft`, the model's own head otherwise) decodes every request speculatively
whose sampling allows it (not one with a response_format; a sampled one drafts chains, since a tree's
sampled drafts need widths its top-k/top-p allow). A request's `moedesk` object may choose for itself:
{"speculative": "off"|"greedy"|"beam"|"auto", "beams": W, "length_penalty": x} (beam search streams
nothing before its best hypothesis is whole). Speculative replies count accepted and rejected drafts in
usage.completion_tokens_details (OpenAI's fields for predicted tokens) and in the `moedesk` stats.

Errors are OpenAI error objects ({"error": {"message", "type", "param", "code"}}): 400 for a body that
is not JSON, a field of the wrong type or range, an unsupported parameter, a prompt that leaves no room in the
context; 401 without the API key (when one is set); 404 for an unknown model, as OpenAI's; 503 with
Retry-After when more requests wait than the queue limit; 500 when the engine fails a step (the other
clients go on).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import random
import time
import uuid
from dataclasses import dataclass, replace

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moedesk.app import (chat_request, server_anthropic, server_batches, server_ollama, server_ollama_pull,
                         server_responses)
from moedesk.app.api_errors import ApiError, error_body
from moedesk.app.host_check import allowed_hosts, host_name
from moedesk.app.model_registry import UNSET, Entry, ModelBusy, ModelPool, NoRoom
from moedesk.app.chat_request import NO_TOOLS, BadField, Tools
from moedesk.engine.decoding import (DRAFT_LENGTH, DRAFT_WIDTH, SPECULATIVE_MODES, Decoding, decoding_options,
                                     speculative_draft)
from moedesk.engine.errors import MoedeskError
from moedesk.engine.interface import Group, QueueFull, TextDeltas, Update
from moedesk.engine.load.reply_format import CALL_LIST, PLAIN, Parsed, ReplyFormat, starts_in_reasoning
from moedesk.engine.load.reply_stream import ReplyStream
from moedesk.engine.requests import TEMPERATURE_MAX, Completion, Request, SamplingParams

MAX_BODY_BYTES = 8 << 20  # a prompt of a whole context is far less; more is a mistake or an attack
DEFAULT_MAX_QUEUE = 64
DISCONNECT_POLL_S = 0.5  # how often a plain (non-streamed) request checks that its client is still there
MAX_CHOICES = 128  # OpenAI's limit on `n`
MAX_BEAMS = 16  # a search holds beams x context of KV cache: one client must not take the GPU's memory
EXTENSION_KEYS = ("speculative", "beams", "length_penalty")
SHUTDOWN_GRACE_S = 5.0  # on SIGTERM or ctrl+c, replies being written get this long before each is ended
CUT = object()  # put on an open job's queue when the server stops before its reply is done


@dataclass(frozen=True)
class Speculation:
    """The server's speculative decoding (the serve flags): the mode of requests that do not choose one, and the
    draft head (None: the model's own, looked up when a request asks)."""

    default: str = "off"
    draft: object = None
    draft_length: int = DRAFT_LENGTH
    draft_width: int = DRAFT_WIDTH


@dataclass
class Prepared:
    """A validated request, ready for the scheduler."""

    request: Request
    stream: bool
    include_usage: bool
    chat: bool
    model: str
    decoding: object = None  # BeamOptions, SpeculativeOptions or None (Engine.submit's)
    reply: ReplyFormat = PLAIN  # how the model marks reasoning and tool calls
    in_reasoning: bool = False  # the prompt ended inside an open think tag
    tools: Tools = NO_TOOLS


class ReplyReader:
    """A request's engine updates as reply pieces: reasoning, answer and tool calls told apart
    (engine.load.reply_format), never a partial character nor the possible start of a stop string. A reply forced
    to call tools is the grammar's JSON list of calls, read as the CALL_LIST family."""

    def __init__(self, prepared: Prepared, tokenizer):
        self.prepared, self.tokenizer = prepared, tokenizer
        self.deltas = TextDeltas(prepared.request.params.stop)
        forced = prepared.tools.forced is not None
        fmt = CALL_LIST if forced else prepared.reply
        self.raw = fmt.keeps_special_tokens and tokenizer is not None
        # such a reply's markers are special tokens: its text is decoded with them kept, a token at a time
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=False) if self.raw else None
        self.raw_text = ""
        self.calls_sent = 0
        tools = prepared.tools.offered is not None
        self.stream = ReplyStream(fmt, in_reasoning=prepared.in_reasoning and not forced, tools=tools)

    def piece(self, update: Update) -> Parsed:
        self.deltas.chunk(update)
        if self.raw and update.token_id is not None:
            self.raw_text += self.decoder.step(update.token_id)
        return self._limited(self.stream.update(self.raw_text if self.raw else self.deltas.shown))

    def last(self, done: Completion) -> Parsed:
        """What the finished reply adds; afterwards `whole` is all of it."""
        self.deltas.last(done)
        text = self.tokenizer.decode(done.token_ids, skip_special_tokens=False) if self.raw else done.text
        return self._limited(self.stream.update(text, final=True))

    def _limited(self, new: Parsed) -> Parsed:
        if not self.prepared.tools.parallel:  # parallel_tool_calls false: the first call only
            new = replace(new, tool_calls=new.tool_calls[:max(0, 1 - self.calls_sent)],
                          call_deltas=tuple(d for d in new.call_deltas if d.index == 0))
        self.calls_sent += len(new.tool_calls)
        return new

    @property
    def whole(self) -> Parsed:
        shown = self.stream.shown
        return shown if self.prepared.tools.parallel else replace(shown, tool_calls=shown.tool_calls[:1])

@dataclass(eq=False)  # hashed by identity: the server keeps its open jobs in a set
class Job:
    """A submitted request: its engine handle, the queue its updates arrive on, and their reader."""

    prepared: Prepared
    handle: object
    updates: asyncio.Queue
    reader: ReplyReader
    release: object = None  # called once when the job is over: its model may unload

    def end(self) -> None:
        """Free its row (a no-op once finished) and release its model; safe to call again."""
        self.handle.cancel()
        self.release()


class Server:
    """The HTTP front of a loaded engine, or of several models loaded one at a time (app.model_registry)."""

    def __init__(self, engine=None, *, api_key: str | None = None, batch_size: int = 8,
                 max_queue: int = DEFAULT_MAX_QUEUE, model_name: str | None = None,
                 speculation: Speculation | None = None, cors: tuple[str, ...] = (),
                 models: ModelPool | None = None, hosts: frozenset[str] | None = None):
        # the server's requests for a model decode at most batch_size at once (its Group)
        self.pool = models or ModelPool.of_engine(engine, model_name or engine.name, Group(batch_size))
        self.hosts = hosts  # without a key, only these Host names are answered (app.host_check); None: any
        self.speculation = speculation or Speculation()
        self.api_key = api_key or None
        self.max_queue = max_queue
        self.model_id = self.pool.entries[0].name
        self.created = int(time.time())
        self.open_jobs: set[Job] = set()  # submitted and not yet answered: what a shutdown must end properly
        self.stopping = False
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            # each OpenAI route also without /v1, as llama-server serves them (llama.cpp's own clients and tests)
            *(route for prefix in ("/v1", "") for route in (
                Route(f"{prefix}/models", self.models, methods=["GET"]),
                Route(f"{prefix}/models/{{model_id:path}}", self.model, methods=["GET"]),
                Route(f"{prefix}/chat/completions", self.chat_completions, methods=["POST"]),
                Route(f"{prefix}/completions", self.completions, methods=["POST"]))),
            Route("/moedesk/stats", self.stats, methods=["GET"]),
            *server_responses.routes(self), *server_anthropic.routes(self), *server_batches.routes(self),
            *server_ollama.routes(self), *server_ollama_pull.routes(self),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed, 500: self._internal},
            middleware=_cors(cors))

    @property
    def engine(self):
        """The loaded model's engine (None when none is): a request holds its model loaded from `start` on."""
        current = self.pool.current
        return current.engine if current is not None else None

    @property
    def group(self):
        current = self.pool.current
        return current.group if current is not None else None

    def entry(self, name) -> Entry:
        """The model a request names; 404 as OpenAI's (the openai client's NotFoundError) for an unknown one."""
        entry = self.pool.find(name) if isinstance(name, str) and name else None
        if entry is None:
            served = ", ".join(f"'{e.name}'" for e in self.pool.entries)
            raise ApiError(404, f"The model '{name}' does not exist; this server serves {served} and the models in "
                                f"its local caches", "model", "model_not_found")
        return entry

    # --- endpoints --------------------------------------------------------------------------

    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: HttpRequest) -> Response:
        self._authorise(request)
        return JSONResponse({"object": "list", "data": [self._model_card(e) for e in self.pool.listing()]})

    async def model(self, request: HttpRequest) -> Response:
        self._authorise(request)
        return JSONResponse(self._model_card(self.entry(request.path_params["model_id"])))

    async def stats(self, request: HttpRequest) -> Response:
        self._authorise(request)
        current = self.pool.current
        if current is None:
            return JSONResponse({"model": None, "max_queue": self.max_queue})
        return JSONResponse({"model": current.name,
                             "description": _public(self.engine.description, {self.engine.name: current.name}),
                             "batch_size": self.group.limit, "max_queue": self.max_queue,
                             "speculative": self.speculation.default,
                             "context_length": self.engine.context_length,
                             "scheduler": self.engine.queue_stats(), "experts": self.engine.expert_stats()})

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: HttpRequest) -> Response:
        return await self._complete(request, chat=False)

    # --- one completion ---------------------------------------------------------------------

    async def _complete(self, http: HttpRequest, chat: bool) -> Response:
        self._authorise(http)
        body = await self._json_body(http)
        jobs = await self.start_choices(body, chat)
        reply_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if jobs[0].prepared.stream:
            return self.streaming(self._events(jobs, reply_id))
        tasks = [asyncio.ensure_future(self.finish(http, job)) for job in jobs]
        try:
            dones = await asyncio.gather(*tasks)
        except BaseException:
            for task, job in zip(tasks, jobs):  # one failed: the others' rows are freed too
                task.cancel()
                job.end()
            raise
        if any(done is None for done in dones):
            return Response(status_code=499)
        return JSONResponse(self.completions_body(jobs, dones, reply_id))

    async def start_choices(self, body: dict, chat: bool) -> list[Job]:
        """OpenAI's `n`: one job a choice, each sampling on its own (with a `seed`, choice i takes seed + i, so the
        reply is repeatable and its choices differ)."""
        n = _field(body, "n", int, default=1, minimum=1, maximum=MAX_CHOICES)
        if n == 1:
            return [await self.start(body, chat)]
        seed = _field(body, "seed", int, default=None)
        jobs = []
        try:
            for i in range(n):
                jobs.append(await self.start({**body, "n": 1, **({} if seed is None else {"seed": seed + i})}, chat))
        except BaseException:
            for job in jobs:
                job.end()
            raise
        return jobs

    def completions_body(self, jobs: list[Job], dones: list[Completion], reply_id: str) -> dict:
        """A whole chat or text completion as OpenAI's API returns it, one choice a job; the `moedesk` field is the
        first choice's."""
        chat = jobs[0].prepared.chat
        choices = []
        for index, (job, done) in enumerate(zip(jobs, dones)):
            whole = job.reader.whole
            if chat:
                message = {"role": "assistant", "content": whole.content if whole.content or not whole.tool_calls
                           else None, "refusal": None}
                if whole.reasoning:
                    message["reasoning_content"] = whole.reasoning
                if whole.tool_calls:
                    message["tool_calls"] = [_openai_call(call, i, reply_id)[1]
                                             for i, call in enumerate(whole.tool_calls)]
                choices.append({"index": index, "message": message, "logprobs": None,
                                "finish_reason": _finish(done, whole)})
            else:
                choices.append({"index": index, "text": done.text, "logprobs": None, "finish_reason": _finish(done)})
        return {"id": reply_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": jobs[0].prepared.model, "choices": choices,
                "usage": _usage(*dones), "moedesk": _extension(dones[0])}

    # --- the request path every API shares ------------------------------------------------------

    async def start(self, body: dict, chat: bool, keep_alive=UNSET) -> Job:
        """Validate an OpenAI-style body, load its model if need be, and put it on the scheduler (503 when the queue
        is full, or the model cannot load now). keep_alive: how long the model stays loaded once idle after this
        request (Ollama's per-request field; UNSET: the server's --keep-alive)."""
        if self.stopping:
            raise _stopping_error()
        entry = await self.acquire(_field(body, "model", str, required=True))
        released = False
        job = None

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.open_jobs.discard(job)
                self.pool.release(entry, keep_alive)
        try:
            job = await self._start(body, chat, entry, release)
        except BaseException:
            release()
            raise
        self.open_jobs.add(job)
        return job

    def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> int:
        """The server is shutting down (call on its event loop): new requests get 503 at once; replies being written
        may finish within `grace_s`, then each still open ends as a failed request does (an error event and
        [DONE], an Ollama line with done, a 503), never a stream just cut. Returns how many are open now."""
        if not self.stopping:
            self.stopping = True
            asyncio.get_running_loop().call_later(grace_s, self._cut_open_jobs)
        return len(self.open_jobs)

    def _cut_open_jobs(self) -> None:
        for job in list(self.open_jobs):
            self.cut(job)

    @staticmethod
    def cut(job: Job) -> None:
        """End an open job before its reply is done: its row is freed at the next step, and its reply fails as cut."""
        job.handle.cancel()
        job.updates.put_nowait(CUT)

    async def acquire(self, name: str) -> Entry:
        """The model `name` loaded and held for one request (ModelPool.release gives it back): 404 for an unknown
        one, 503 with the reason when it cannot load now."""
        entry = self.entry(name)
        try:
            return await self.pool.acquire(entry)
        except ModelBusy as e:
            raise ApiError(503, str(e), "model", "model_busy", kind="server_error",
                           headers={"Retry-After": str(e.holder.engine.retry_after())}) from None
        except NoRoom as e:
            raise ApiError(503, str(e), "model", "insufficient_memory", kind="server_error") from None
        except MoedeskError as e:
            raise ApiError(503, f"'{entry.name}' cannot load: {_public(str(e), {entry.source: entry.name})}", "model",
                           "model_load_failed",
                           kind="server_error") from None

    async def _start(self, body: dict, chat: bool, entry: Entry, release) -> Job:
        # Tokenising, the chat template and compiling a schema are CPU work: off the event loop.
        prepared = await run_in_threadpool(self._prepare, body, chat)
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Update] = asyncio.Queue()

        def sink(update: Update) -> None:  # on the decode thread; a plain reply only needs the last update
            if prepared.stream or update.final:
                loop.call_soon_threadsafe(updates.put_nowait, update)

        try:
            handle = entry.engine.submit(prepared.request, decoding=prepared.decoding, group=entry.group,
                                        queue_limit=self.max_queue, sink=sink)
        except QueueFull as e:
            retry = entry.engine.retry_after()
            raise ApiError(503, f"The server is busy: {e}. Retry after {retry} s.", code="queue_full",
                           kind="server_error", headers={"Retry-After": str(retry)}) from None
        return Job(prepared, handle, updates, ReplyReader(prepared, entry.engine.tokenizer), release)

    async def reply(self, http: HttpRequest, job: Job, events, whole, media_type: str = "text/event-stream") -> Response:
        """A started job's response, for every API: `events()` streamed when the request asked for a stream, else
        the completion waited for and `whole(done)` as JSON; 499 when the client went away first."""
        if job.prepared.stream:
            return self.streaming(events(), media_type)
        done = await self.finish(http, job)
        if done is None:
            return Response(status_code=499)
        return JSONResponse(whole(done))

    async def finish(self, http: HttpRequest | None, job: Job) -> Completion | None:
        """The completion of a plain (not streamed) job, parsed into job.reader.whole; None when the client went
        away first (its row is freed; http None: a batch's line, with no client to leave); ApiError 500 when the
        engine failed it, 503 when it was cut."""
        try:
            while True:
                try:
                    update = await asyncio.wait_for(job.updates.get(), DISCONNECT_POLL_S)
                    if update is CUT:
                        raise _stopping_error(cut=True)
                    break
                except asyncio.TimeoutError:
                    if http is not None and await http.is_disconnected():
                        return None
        finally:
            job.end()  # frees the row if the client left or this task was cancelled
        if update.error is not None:
            raise _engine_error(update.error)
        job.reader.last(update.completion)
        return update.completion

    async def pieces(self, job: Job):
        """A streamed job's reply: (new pieces, None) as tokens arrive, then (last pieces, completion); an engine
        failure raises ApiError. The row is freed when the consumer stops early (its client went away)."""
        try:
            while True:
                update = await job.updates.get()
                if update is CUT:
                    raise _stopping_error(cut=True)
                if update.error is not None:
                    raise _engine_error(update.error)
                if update.completion is not None:
                    yield job.reader.last(update.completion), update.completion
                    return
                piece = job.reader.piece(update)
                if piece.reasoning or piece.content or piece.tool_calls or piece.call_deltas:
                    yield piece, None
        finally:
            job.end()

    @staticmethod
    def streaming(events, media_type: str = "text/event-stream") -> StreamingResponse:
        return StreamingResponse(events, media_type=media_type,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self, jobs: list[Job], reply_id: str):
        """Server-sent events: one chunk per piece of a choice's reply (the choices' chunks interleaved as they
        come), each choice's last with its finish_reason; then the usage of them all when asked."""
        prepared = jobs[0].prepared
        chat = prepared.chat
        head = {"id": reply_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": prepared.model}
        dones: list[Completion | None] = [None] * len(jobs)

        def chunk(index: int, delta: dict | None, finish: str | None = None, **extra) -> bytes:
            if chat:
                choice = {"index": index, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": index, "text": (delta or {}).get("content", ""), "logprobs": None,
                          "finish_reason": finish}
            if prepared.include_usage:
                extra.setdefault("usage", None)
            return _sse({**head, "choices": [choice], **extra})

        async def choice_events(index: int, job: Job):
            if chat:
                yield chunk(index, {"role": "assistant", "content": None})  # null, not "": no delta's content is empty
            async for piece, done in self.pieces(job):
                if piece.reasoning and chat:
                    yield chunk(index, {"reasoning_content": piece.reasoning})
                if piece.content:
                    yield chunk(index, {"content": piece.content})
                for delta in piece.call_deltas:  # OpenAI's: id, type and name first, then argument fragments
                    if delta.name is not None:
                        body = _openai_call(delta, delta.index, reply_id)[1]
                    else:
                        body = {"function": {"arguments": delta.arguments}}
                    yield chunk(index, {"tool_calls": [{"index": delta.index, **body}]})
                if done is not None:
                    dones[index] = done
                    yield chunk(index, None, _finish(done, job.reader.whole), moedesk=_extension(done))

        try:
            async for event in _merged([choice_events(i, job) for i, job in enumerate(jobs)]):
                yield event
            if prepared.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(*dones)})
            yield b"data: [DONE]\n\n"
        except ApiError as error:
            yield _sse(error_body(error.message, error.kind, code=error.code))
            yield b"data: [DONE]\n\n"
        finally:
            for job in jobs:  # the client went away mid-stream: the rows are freed at the next step
                job.end()

    # --- validation ---------------------------------------------------------------------------

    def _authorise(self, http: HttpRequest) -> None:
        if self.api_key is None:
            if self.hosts is not None and host_name(http.headers.get("host", "")) not in self.hosts:
                raise ApiError(403, "This server answers only requests addressed to its own host name (a guard "
                                    "against DNS rebinding): start it with --allow-host NAME or --api-key KEY",
                               code="host_not_allowed")
            return
        scheme, _, key = http.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            key = http.headers.get("x-api-key", "")  # as Anthropic's clients send it
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY') "
                                "with the key the server was started with (--api-key)", code="invalid_api_key")

    async def _json_body(self, http: HttpRequest) -> dict:
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"The request body is larger than {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
        raw = bytearray()
        async for piece in http.stream():
            raw += piece
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"The request body is larger than {MAX_BODY_BYTES >> 20} MiB",
                               code="body_too_large")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "We could not parse the JSON body of your request: send a JSON object",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"The request body must be a JSON object, not {_kind(body)}", code="invalid_json")
        return body

    def _prepare(self, body: dict, chat: bool) -> Prepared:
        engine = self.engine
        model = body["model"]  # found and loaded by `start`
        for name, neutral in (("n", 1), ("best_of", 1), ("presence_penalty", 0), ("frequency_penalty", 0),
                              ("logprobs", None), ("top_logprobs", None), ("echo", False), ("suffix", None),
                              ("functions", None), ("logit_bias", None)) + ((("tools", None),) if not chat else ()):
            value = body.get(name)
            if value is not None and value != neutral and not (name == "logprobs" and value is False) \
                    and not (name in ("tools", "functions", "logit_bias") and not value):
                raise ApiError(400, f"'{name}' is not supported by this server (only {neutral!r})", name,
                               "unsupported_parameter")
        # The deprecated functions API: without functions, "none" and "auto" both mean plain text.
        if body.get("function_call") not in (None, "none", "auto"):
            raise ApiError(400, "'function_call' is not supported by this server: use tools and tool_choice",
                           "function_call", "unsupported_parameter")
        try:
            tools = chat_request.tools(body) if chat else NO_TOOLS
        except BadField as e:
            raise ApiError(400, str(e), e.param, e.code) from None
        if not chat and body.get("tool_choice") not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs /v1/chat/completions", "tool_choice", "unsupported_parameter")
        ids, reply, in_reasoning = self._prompt_ids(body, chat, tools)
        context = engine.context_length
        if len(ids) >= context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens; the prompt has "
                                f"{len(ids)}, which leaves no room for a reply", "messages" if chat else "prompt",
                           "context_length_exceeded")
        max_tokens = _field(body, "max_completion_tokens" if body.get("max_completion_tokens") is not None
                            else "max_tokens", int, minimum=1)
        room = context - len(ids)
        # Omitted values: the model's own defaults (generation_config.json, GGUF metadata), else OpenAI's.
        recommended = getattr(engine, "generation_defaults", None) or {}
        temperature = _field(body, "temperature", float, minimum=0, maximum=TEMPERATURE_MAX,
                             default=min(TEMPERATURE_MAX, recommended.get("temperature", 1.0)))
        top_p = _field(body, "top_p", float, default=recommended.get("top_p", 1.0))
        if not 0 < top_p <= 1:
            raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p", "invalid_value")
        top_k = _field(body, "top_k", int, minimum=0, default=recommended.get("top_k", 0))  # an extension llama.cpp's and vLLM's servers share
        seed = _field(body, "seed", int, default=None)
        if seed is None:
            seed = random.randrange(2**63)
        elif not 0 <= seed < 2**64:
            seed %= 2**64  # OpenAI takes any 64-bit seed, negative ones included
        try:
            stop = chat_request.stop_strings(body.get("stop"))
        except BadField as e:
            raise ApiError(400, str(e), e.param, e.code) from None
        stream = _field(body, "stream", bool, default=False)
        options = body.get("stream_options")
        include_usage = False
        if options is not None:
            if not stream:
                raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options",
                               "invalid_value")
            if not isinstance(options, dict):
                raise ApiError(400, "stream_options must be an object", "stream_options", "invalid_type")
            include_usage = _field(options, "include_usage", bool, default=False, where="stream_options.")
        ignore_eos = _field(body, "ignore_eos", bool, default=False)  # an extension, as vLLM's
        grammar = None
        response_format = body.get("response_format")
        if tools.forced is not None:
            if response_format not in (None, {"type": "text"}):
                raise ApiError(400, "response_format and a tool_choice that forces a call exclude each other",
                               "response_format", "invalid_value")
            response_format = chat_request.forced_response_format(tools.forced)
        if response_format is not None:
            try:
                grammar = engine.grammar(response_format)
            except (ValueError, MoedeskError) as e:
                param = "response_format" if tools.forced is None else "tools"
                raise ApiError(400, str(e), param, "invalid_value") from None
        params = SamplingParams(max_new_tokens=min(max_tokens or room, room), temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, stop=stop, ignore_eos=ignore_eos)
        decoding = self._decoding(body.get("moedesk"), params, grammar is not None)
        return Prepared(Request(ids, params, grammar=grammar), stream, include_usage, chat, model, decoding,
                        reply, in_reasoning, tools)

    def _decoding(self, extension, params: SamplingParams, constrained: bool):
        """How this request decodes: its `moedesk` object's choice, else the server's speculative mode where the
        request's sampling allows it, else plainly."""
        if extension is None:
            extension = {}
        if not isinstance(extension, dict):
            raise ApiError(400, f"'moedesk' must be an object, got {_kind(extension)}", "moedesk", "invalid_type")
        unknown = sorted(set(extension) - set(EXTENSION_KEYS))
        if unknown:
            raise ApiError(400, f"'moedesk.{unknown[0]}' is not a moedesk option (they are: "
                                f"{', '.join(EXTENSION_KEYS)})", f"moedesk.{unknown[0]}", "unknown_parameter")
        mode = _field(extension, "speculative", str, where="moedesk.")
        if mode is not None and mode not in SPECULATIVE_MODES:
            raise ApiError(400, f"'moedesk.speculative' must be one of {', '.join(SPECULATIVE_MODES)}, got {mode!r}",
                           "moedesk.speculative", "invalid_value")
        beams = _field(extension, "beams", int, minimum=1, maximum=MAX_BEAMS, default=1, where="moedesk.")
        length_penalty = _field(extension, "length_penalty", float, minimum=-10, maximum=10, default=1.0,
                                where="moedesk.")
        if beams > 1:
            if mode not in (None, "off"):
                raise ApiError(400, "'moedesk.beams' above 1 and 'moedesk.speculative' exclude each other: choose one",
                               "moedesk.beams", "invalid_value")
            if constrained:
                raise ApiError(400, "beam search cannot take a response_format", "moedesk.beams", "invalid_value")
            return decoding_options(self.engine, Decoding(beams=beams, length_penalty=length_penalty))
        asked = mode is not None
        mode = mode if asked else self.speculation.default
        if mode == "off":
            return None
        if constrained:
            if asked:
                raise ApiError(400, "speculative decoding cannot take a response_format", "moedesk.speculative",
                               "invalid_value")
            return None  # the server's default applies only where the request allows it
        if mode == "beam" and params.temperature > 0:
            # A sampled tree draws each node's children from the draft, and fails a row whose top-k/top-p leaves
            # fewer candidates than the width; chains are exact for any sampling.
            mode = "greedy"
        s = self.speculation
        return decoding_options(self.engine, Decoding(mode, self._draft(), s.draft_length, s.draft_width))

    def _draft(self):
        """The server's draft head: its flag's, else the model's own (resolved and loaded on first use)."""
        if self.speculation.draft is None:
            try:
                draft = speculative_draft(self.engine, None)
            except MoedeskError as e:
                raise ApiError(400, f"This server cannot decode speculatively: {e}", "moedesk.speculative",
                               "invalid_value") from None
            self.speculation = replace(self.speculation, draft=draft)
        return self.speculation.draft

    def _prompt_ids(self, body: dict, chat: bool, tools: Tools = NO_TOOLS) -> tuple[list[int], ReplyFormat, bool]:
        """The prompt's token ids, how the reply will mark reasoning and tool calls, and whether the prompt leaves
        it inside an open think tag."""
        tokenizer = self.engine.tokenizer
        if chat:
            messages = body.get("messages")
            if messages is None:
                raise ApiError(400, "Missing required parameter: 'messages'", "messages", "missing_required_parameter")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages",
                               "invalid_value" if isinstance(messages, list) else "invalid_type")
            try:
                plain = [chat_request.message(m, i) for i, m in enumerate(messages)]
                options = chat_request.template_options(body)
            except BadField as e:
                raise ApiError(400, str(e), e.param, e.code) from None
            if tokenizer is not None and "developer" not in (tokenizer.chat_template or ""):
                # OpenAI's newer clients say "developer" for "system"; a template that does not name it would write
                # a role the model never saw, or (Qwen3's) drop the message
                plain = [{**m, "role": "system"} if m["role"] == "developer" else m for m in plain]
            if tokenizer is None:
                raise ApiError(400, "The model has no tokenizer: use /v1/completions with token ids", "messages")
            try:
                text = tokenizer.render_chat(plain, tools=tools.offered, **options)
                ids = tokenizer.encode(text, add_special_tokens=False)
            except MoedeskError as e:
                raise ApiError(400, _public(str(e), {str(getattr(tokenizer, "source", "")): "the model",
                                                     self.engine.name: self.pool.current.name}), "messages") from None
            except Exception as e:  # noqa: BLE001 -- odd text (lone surrogates) is the client's problem, not a crash
                raise ApiError(400, f"Cannot tokenise the messages: {e}", "messages") from None
            reply = tokenizer.reply_format
            return ids, reply, starts_in_reasoning(reply, text)
        if "prompt" not in body:
            raise ApiError(400, "Missing required parameter: 'prompt'", "prompt", "missing_required_parameter")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            vocab = self.engine.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"Token id {bad} in the prompt is outside the vocabulary [0, {vocab})", "prompt",
                               "invalid_value")
            return list(prompt), PLAIN, False
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt",
                           "invalid_type")
        if not prompt:
            raise ApiError(400, "prompt must not be empty", "prompt", "invalid_value")
        if tokenizer is None:
            raise ApiError(400, "The model has no tokenizer: give the prompt as token ids", "prompt")
        try:
            ids = tokenizer.encode(prompt)
        except Exception as e:  # noqa: BLE001 -- odd text (lone surrogates) is the client's problem, not a crash
            raise ApiError(400, f"Cannot tokenise the prompt: {e}", "prompt") from None
        if not ids:
            raise ApiError(400, "The prompt has no tokens", "prompt", "invalid_value")
        return ids, PLAIN, False

    def _model_card(self, entry: Entry) -> dict:
        card = {"id": entry.name, "object": "model", "created": self.created, "owned_by": "moedesk",
                "loaded": entry.loaded}
        if entry.loaded:
            card["context_length"] = entry.engine.context_length
        return card

    # --- errors outside the endpoints -----------------------------------------------------------

    async def _not_found(self, request, exc) -> Response:
        return JSONResponse(error_body(f"Unknown path {request.url.path}", "invalid_request_error",
                                       code="unknown_url"), 404)

    async def _not_allowed(self, request, exc) -> Response:
        return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}",
                                       "invalid_request_error", code="method_not_allowed"), 405)

    async def _internal(self, request, exc) -> Response:
        return JSONResponse(error_body(f"Internal server error: {type(exc).__name__}", "server_error"), 500)


def _cors(origins: tuple[str, ...]) -> list:
    """Browser pages of these origins may call the API (none unless --cors names them: a page on any site could
    otherwise drive a server on localhost). The API key is still asked of every request."""
    if not origins:
        return []
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    return [Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["*"], max_age=600)]


def build_app(engine, **options) -> Starlette:
    """The ASGI app serving `engine` (options: see Server)."""
    server = Server(engine, **options)
    server.app.add_exception_handler(ApiError, lambda request, exc: exc.response())
    server.app.state.server = server
    return server.app


def run_server(engine, host: str = "127.0.0.1", port: int = 8000, log=print, allow_hosts: tuple[str, ...] = (),
               grace_s: float = SHUTDOWN_GRACE_S, **options) -> int:
    import uvicorn

    class Uvicorn(uvicorn.Server):
        """uvicorn that tells the server when a signal asks it to stop, so that open replies end properly."""

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit and getattr(self, "loop", None) is not None:
                self.loop.call_soon_threadsafe(stopping)
            super().handle_exit(sig, frame)

    def stopping() -> None:
        open_now = server.stop(grace_s)
        if open_now:
            log(f"moedesk serve: stopping; {open_now} open repl{'y gets' if open_now == 1 else 'ies get'} "
                f"{grace_s:g} s to finish")

    app = build_app(engine, hosts=allowed_hosts(host, allow_hosts), **options)
    server: Server = app.state.server
    others = [e.name for e in server.pool.entries[1:]]
    log(f"moedesk serve: {engine.description}; http://{host}:{port}/v1 as model '{server.model_id}'"
        + (f" (and {', '.join(repr(n) for n in others)} on first use)" if others else "") + "; "
        f"{server.group.limit} requests decode together, {server.max_queue} may wait"
        + (f"; speculative {server.speculation.default}" if server.speculation.default != "off" else "")
        + ("" if server.api_key else "; no API key"))
    # uvicorn cancels what is still running this long after the signal: after the cut replies have been ended
    Uvicorn(uvicorn.Config(app, host=host, port=port, log_level="info",
                           timeout_graceful_shutdown=grace_s + 5)).run()
    return 0


# --- small helpers --------------------------------------------------------------------------------

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}


def _field(body: dict, name: str, kind, *, required=False, default=None, minimum=None, maximum=None, where=""):
    """body[name] checked against kind (float accepts integers; bool is never a number); None means absent."""
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"Missing required parameter: '{where}{name}'", where + name,
                           "missing_required_parameter")
        return default
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise ApiError(400, f"'{where}{name}' must be {_TYPE_NAMES[kind]}, got {_kind(value)}", where + name,
                       "invalid_type")
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise ApiError(400, f"'{where}{name}' must be {bounds}, got {value}", where + name, "invalid_value")
    return float(value) if kind is float else value


def _public(text: str, names: dict[str, str]) -> str:
    """`text` with each local path in `names` replaced by what clients may see (the model's id): where the model
    lies on this machine is not theirs to learn from an error message or the stats."""
    for path, name in sorted(names.items(), key=lambda item: -len(item[0])):  # the longest first: a file in a folder
        if path:
            text = text.replace(path, name)
    return text


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float) and not math.isfinite(value):  # json.loads takes NaN and Infinity
        return "NaN" if value != value else "Infinity" if value > 0 else "-Infinity"
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__)


def _finish(done: Completion, whole: Parsed | None = None) -> str:
    if whole is not None and whole.tool_calls:
        return "tool_calls"
    return "length" if done.finish_reason == "length" else "stop"


def _openai_call(call, index: int, reply_id: str) -> tuple[int, dict]:
    """A parsed tool call as OpenAI's message.tool_calls entry, its id unique within the reply."""
    return index, {"id": f"call_{reply_id[-12:]}{index}", "type": "function",
                   "function": {"name": call.name, "arguments": call.arguments}}


def _usage(*dones: Completion) -> dict:
    """Usage of a reply's choices: their prompt (the same for every choice) once, their tokens together."""
    prompt, tokens = dones[0].prompt_tokens, sum(len(done.token_ids) for done in dones)
    usage = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
    specs = [done.stats.get("speculative") or {} for done in dones]
    if all("drafted" in spec for spec in specs):  # OpenAI's fields for predicted tokens: drafts accepted, rejected
        accepted = sum(spec["accepted"] for spec in specs)
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": sum(s["drafted"] for s in specs) - accepted}
    return usage


async def _merged(streams: list):
    """The items of several async generators as each yields them; one's exception ends them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(stream) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(end)
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put(error)
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is end:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def _extension(done: Completion) -> dict:
    """The `moedesk` field: what batch output's stats hold (timings, shared steps, expert work) and the token ids."""
    return {**done.stats, "token_ids": list(done.token_ids)}


def _stopping_error(cut: bool = False) -> ApiError:
    what = "this reply was cut short" if cut else "it takes no new requests"
    return ApiError(503, f"The server is shutting down: {what}.", code="server_shutting_down", kind="server_error")


def _engine_error(error: BaseException) -> ApiError:
    return ApiError(500, f"The engine failed this request: {' '.join(str(error).split()) or type(error).__name__}",
                    kind="server_error", code="engine_error")


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"
