"""`RemoteEngine`: generation on an OpenAI-compatible server (vLLM, SGLang, llama-server, another `moedesk serve`).

The model's tokenizer and chat template are read here from the local model files (`--model` as for the other
engines), so every front end renders and tokenizes as it always does and sends token ids. Each request is one
streamed POST /v1/completions (engine.remote.protocol); requests that arrive together are sent together
(engine.remote.scheduler), so the server batches them. What a server does not report (expert placement, the heat
map, expert statistics) is said to be unavailable, never made up. A server that cannot be reached, refuses the key,
times out or goes away mid-reply fails the request with one line (RemoteUnavailable); nothing is retried behind the
caller's back: a batch run stops and resumes on the next run, the chat keeps its conversation.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from dataclasses import dataclass

import httpx

from moedesk.engine.errors import MoedeskError
from moedesk.engine.generation.scheduler import Handle, Update
from moedesk.engine.interface import DEFAULT_CONTEXT, EngineFace
from moedesk.engine.model.config import ModelConfig
from moedesk.engine.remote import protocol
from moedesk.engine.remote.protocol import RemoteError, RemoteUnavailable
from moedesk.engine.remote.scheduler import RemoteScheduler
from moedesk.engine.requests import Completion

API_KEY_VARIABLE = "MOEDESK_REMOTE_API_KEY"
CONNECT_TIMEOUT_S = 10.0
# Between two events of a reply: a long prompt's prefill on a busy server may take minutes before the first.
READ_TIMEOUT_S = 300.0
UNAVAILABLE = "not available: the server runs the model and does not report it"


@dataclass(frozen=True)
class RemoteDevice:
    """Where the model runs, as front ends read `engine.device.type`."""

    type: str = "remote"


@dataclass(frozen=True)
class RemoteFormat:
    """A response_format passed through to the server, which constrains its own sampling (Request.grammar)."""

    response_format: dict


class RemoteEngine(EngineFace):
    kind = "remote"

    def __init__(self, client: httpx.Client, url: str, served_model: str, tokenizer, config, context_length: int,
                 name: str, generation_defaults: dict | None = None):
        self.client, self.url, self.served_model = client, url, served_model
        self.tokenizer, self.config = tokenizer, config
        self.vocab_size = config.vocab_size
        self.context_length = context_length
        self.name = name
        self.device = RemoteDevice()
        self.dtype = None
        self.orchestra = None
        self.generation_defaults = generation_defaults or {}
        self.warnings: list[str] = []
        self.why = f"remote engine: {served_model} at {url}"
        self.cache = _NoCache()
        self.scheduler = RemoteScheduler(self._run)

    @classmethod
    def load(cls, model: str, *, url: str | None = None, api_key: str | None = None,
             context_length: int | None = None, progress=None, timeout: float = READ_TIMEOUT_S,
             **_) -> "RemoteEngine":
        """The local model's tokenizer and config (no weights read), and the server at `url`, asked once for its
        models so that a dead port or a wrong key is one line now rather than at the first request."""
        from moedesk.engine.load.checkpoint import ModelFiles, open_checkpoint
        from moedesk.engine.load.tokenizer import Tokenizer
        from moedesk.engine.model.architectures import parse_config

        root = protocol.base_url(url or "")
        api_key = api_key or os.environ.get(API_KEY_VARIABLE) or None
        folder = Path(os.path.expanduser(model))
        # A folder needs no weights here (its config and tokenizer files are enough): the server has them.
        checkpoint = ModelFiles(folder) if folder.is_dir() else open_checkpoint(model)
        try:
            config = parse_config(checkpoint.config, getattr(checkpoint, "path", "config.json"),
                                  tensors=checkpoint.shapes())
        except MoedeskError:  # one moedesk does not run, or no weights here: described, never computed with
            config = described_config(checkpoint.config)
        if checkpoint.tokenizer is None:
            raise MoedeskError(f"{model}: the remote engine needs the model's tokenizer here, and it has none")
        tokenizer = Tokenizer(checkpoint.tokenizer, checkpoint.tokenizer_config, config.eos_token_ids,
                              source=str(getattr(checkpoint, "path", model)), architecture=config.arch)
        if model == "demo":
            from moedesk.engine.load.demo import recipe
            from moedesk.engine.load.generation_defaults import checked

            defaults = checked(recipe().get("generation", {}))
        else:
            defaults = checkpoint.generation_defaults
        client = httpx.Client(headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                              timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S),
                              limits=httpx.Limits(max_connections=None, max_keepalive_connections=16))
        try:
            served = _get(client, root + "/models")
            data = served.get("data") if isinstance(served, dict) else None
            chosen, warning = protocol.pick_model(data if isinstance(data, list) else [], model)
            card = next(m for m in data if m.get("id") == chosen)
        except BaseException:
            client.close()
            raise
        limit = min(config.max_position_embeddings or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
        context = context_length or protocol.served_context(card) or limit
        engine = cls(client, root, chosen, tokenizer, config, context, model, defaults)
        if warning:
            engine.warnings.append(warning)
        if progress:
            progress("load", 1.0)
        return engine

    # --- one request ---------------------------------------------------------------------------

    def _run(self, handle: Handle) -> Completion:
        """Stream `handle`'s request from the server (on its own thread): an Update per event with text."""
        request = handle.request
        grammar = request.grammar
        body = protocol.completion_body(self.served_model, request,
                                        grammar.response_format if isinstance(grammar, RemoteFormat) else None)
        text, ids, all_ids, reason, prompt_tokens = "", [], None, None, len(request.prompt_ids)
        started, first = time.perf_counter(), None
        try:
            with self.client.stream("POST", self.url + "/completions", json=body) as response:
                if response.status_code != 200:
                    raise protocol.status_error(response.status_code, response.read().decode(errors="replace"),
                                                self.url)
                for line in response.iter_lines():
                    if handle.cancelled:
                        reason = "cancelled"
                        break
                    event = protocol.parse_event(line)
                    if event is None:
                        continue
                    if event.done:
                        break
                    if event.token_ids is not None:
                        if event.all_ids:
                            all_ids = event.token_ids
                        else:
                            ids += event.token_ids
                    if event.prompt_tokens is not None:
                        prompt_tokens = event.prompt_tokens
                    if event.finish_reason is not None:
                        reason = event.finish_reason
                    if event.text:
                        first = first or time.perf_counter()
                        text += event.text
                        handle.sink(Update(None, text))
        except httpx.TimeoutException:
            raise RemoteUnavailable(f"the server at {self.url} sent nothing for too long (timed out)") from None
        except httpx.TransportError as e:
            raise RemoteUnavailable(_transport_line(self.url, e, bool(text))) from None
        if reason is None:  # the stream ended without a finish: the server stopped mid-reply
            raise RemoteUnavailable(f"the server at {self.url} ended the reply before it finished")
        token_ids = all_ids if all_ids is not None else ids
        if not token_ids and text:  # a server that sends no ids: the local tokenizer's reading of the text
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        now = time.perf_counter()
        stats = {"engine": "remote", "total_s": round(now - started, 4)}
        if first is not None:
            stats["ttft_s"] = round(first - started, 4)
        return Completion(request.tag, token_ids, text, "cancelled" if reason == "cancelled"
                          else protocol.finish_reason(reason), prompt_tokens, stats)

    # --- what the other engines have and a server does not report --------------------------------

    def _kind(self, decoding, limit):
        if decoding is None:
            return None
        what = "beam search" if type(decoding).__name__ == "BeamOptions" else "speculative decoding"
        raise MoedeskError(f"{what} is not available on a remote engine: the server decodes (configure speculation "
                           f"on the server itself)")

    def beam_search(self, *args, **kwargs):
        raise MoedeskError("beam search is not available on a remote engine")

    def speculate(self, *args, **kwargs):
        raise MoedeskError("speculative decoding is not available on a remote engine: configure it on the server")

    def load_draft(self, path):
        raise MoedeskError("a draft head is not available on a remote engine: configure speculation on the server")

    def grammar(self, response_format):
        """The response_format itself, checked for shape here and compiled by the server."""
        if response_format is None or response_format == {"type": "text"}:
            return None
        if not isinstance(response_format, dict) or response_format.get("type") not in ("json_object", "json_schema"):
            raise ValueError("response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}")
        return RemoteFormat(response_format)

    @property
    def description(self) -> str:
        cfg = self.config
        shape = f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if cfg.is_moe else "dense"
        return f"{self.name} ({cfg.arch}, {cfg.num_layers} layers, {shape}) on {self.served_model} at {self.url}"

    def expert_map(self) -> tuple[list, list]:
        """No placement nor picks to show: a server does not report them."""
        return [], []

    def expert_stats(self) -> dict:
        return {"engine": self.kind, "placement": UNAVAILABLE} if self.config.is_moe else {}

    def release_cache(self, timeout: float = 30.0) -> bool:
        return True

    def close(self) -> None:
        self.scheduler.close()
        self.client.close()


def described_config(hf: dict) -> ModelConfig:
    """What the app shows of a model moedesk cannot run itself (an architecture or a quantisation the native engine
    does not run) from its config.json: its size and experts, and its special tokens. Nothing here computes with it."""
    def number(*keys, default=0):
        value = next((hf[k] for k in keys if isinstance(hf.get(k), int) and not isinstance(hf.get(k), bool)), None)
        return default if value is None else value

    layers = max(1, number("num_hidden_layers", "n_layer", "num_layers", default=1))
    heads = max(1, number("num_attention_heads", "n_head", default=1))
    hidden = max(1, number("hidden_size", "n_embd", default=1))
    experts = number("n_routed_experts", "num_local_experts", "num_experts")
    dense_first = number("first_k_dense_replace")
    eos = hf.get("eos_token_id")
    eos = tuple(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int))
    bos = hf.get("bos_token_id")
    return ModelConfig(arch=str(hf.get("model_type", "?")), vocab_size=max(1, number("vocab_size", default=1)),
                       hidden_size=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=max(1, number("num_key_value_heads", default=heads)),
                       head_dim=max(1, number("head_dim", default=hidden // heads)),
                       intermediate_size=number("intermediate_size"), rms_norm_eps=0.0,
                       max_position_embeddings=max(1, number("max_position_embeddings", default=DEFAULT_CONTEXT)),
                       num_experts=experts, num_experts_per_tok=number("num_experts_per_tok") if experts else 0,
                       moe_intermediate_size=number("moe_intermediate_size"),
                       moe_layers=tuple(bool(experts) and i >= dense_first for i in range(layers)),
                       bos_token_id=bos if isinstance(bos, int) else None, eos_token_ids=eos)


class _NoCache:
    """The KV cache lives on the server: nothing to size or grow here."""

    rows = 0

    def bytes_per_position(self) -> int:
        return 0

    def ensure(self, rows: int, length: int) -> None:
        pass


def _get(client: httpx.Client, url: str):
    try:
        response = client.get(url)
    except httpx.TimeoutException:
        raise RemoteUnavailable(f"the server at {url.rsplit('/', 1)[0]} did not answer (timed out)") from None
    except httpx.TransportError as e:
        raise RemoteUnavailable(_transport_line(url.rsplit("/", 1)[0], e, False)) from None
    if response.status_code != 200:
        raise protocol.status_error(response.status_code, response.text, url.rsplit("/", 1)[0])
    try:
        return response.json()
    except ValueError:
        raise RemoteError(f"{url} answered something that is not JSON: is this an OpenAI-compatible server?") from None


def _transport_line(url: str, error: Exception, mid_reply: bool) -> str:
    if mid_reply:
        return f"the server at {url} went away mid-reply ({type(error).__name__})"
    detail = " ".join(str(error).split())[:120] or type(error).__name__
    return f"cannot reach the server at {url} ({detail}): is it running, and is the address right?"
