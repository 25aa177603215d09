"""The scheduler's steps through llama.cpp: one llama_batch per step, several sequences in it.

`LlamaCppDecoder` is engine.generation.decoder.Decoder with the model's forward replaced: a prefill piece or a
decode step of every running sequence goes to llama_decode as one batch, each token tagged with its sequence's
id (its scheduler row), so requests that arrive together decode together. Sampling, grammars, stop strings and
completions are the native decoder's own, applied to llama.cpp's logits.
"""
from __future__ import annotations

import ctypes
from typing import Iterator

import numpy as np
import torch

from moedesk.engine.errors import MoedeskError
from moedesk.engine.generation.decoder import Decoder, Sequence
from moedesk.engine.generation.runner import ModelRunner
from moedesk.engine.llamacpp.library import quiet_debug
from moedesk.engine.requests import Request

# llama_decode's statuses (llama.h); -2 and -3 are ggml's allocation and computation failures.
_DECODE_ERRORS = {1: "the KV cache has no room for this batch (a shorter context or fewer sequences at once)",
                  2: "aborted", -1: "the batch is invalid",
                  -2: "out of memory for the computation (a shorter context or fewer sequences at once)",
                  -3: "the computation failed (llama.cpp's log says why)"}


class NoContext(MoedeskError):
    """llama.cpp could not make a context (llama_init_from_model gave NULL): its log says why."""


class LlamaContext:
    """A llama.cpp context over a loaded model: `slots` sequences of `context_length` positions each, and the
    batch every step is written into. Used by the decode thread only (and by `resize` while nothing runs)."""

    def __init__(self, api, model, context_length: int, slots: int, batch_tokens: int, threads: int,
                 offload_kv: bool, counter=None):
        """counter: an engine.llamacpp.expert_counts.ExpertCounter whose callback the context runs (None: none)."""
        self.api, self.model, self.counter = api, model, counter
        self.context_length, self.batch_tokens, self.threads, self.offload_kv = context_length, batch_tokens, threads, offload_kv
        self.n_vocab = int(api.llama_vocab_n_tokens(api.llama_model_get_vocab(model)))
        self.ctx, self.slots = None, 0
        self.batch = api.llama_batch_init(batch_tokens, 0, 1)
        try:
            self.resize(slots)
        except BaseException:
            self.close()
            raise

    def resize(self, slots: int) -> None:
        """A new context for `slots` sequences; what the old one held is gone (call it when nothing runs)."""
        api = self.api
        params = api.llama_context_default_params()
        params.n_seq_max = slots
        params.n_ctx = self.context_length * slots
        # One stream of cells per sequence: each attends over its own positions only (serve's clients share no
        # prefix), and a sequence's room is its context, whatever the others hold.
        params.kv_unified = False
        # A step's tokens go in one call (n_batch); llama.cpp computes them in micro-batches of its default size,
        # as llama-bench and llama-server do.
        params.n_batch, params.n_ubatch = self.batch_tokens, min(params.n_ubatch, self.batch_tokens)
        params.n_threads = params.n_threads_batch = self.threads
        params.offload_kqv = self.offload_kv
        params.no_perf = True
        if self.counter is not None:
            params.cb_eval, params.cb_eval_user_data = self.counter.callback, self.counter.user_data
        ctx = api.llama_init_from_model(self.model, params)
        if not ctx:
            raise NoContext(f"llama.cpp could not make a context of {slots} x {self.context_length} positions "
                            f"(out of memory?): use a shorter --context")
        if self.ctx is not None:
            api.llama_free(self.ctx)
        self.ctx, self.slots = ctx, slots

    def set_threads(self, threads: int) -> None:
        """The threads of the steps that follow, for one token and for many (engine.cpu_share)."""
        self.threads = threads
        self.api.llama_set_n_threads(self.ctx, threads, threads)

    def forget(self, seq_id: int) -> None:
        """Drop what sequence `seq_id` holds in the KV cache (its row starts a new request)."""
        self.api.llama_memory_seq_rm(self.api.llama_get_memory(self.ctx), seq_id, -1, -1)

    def run(self, pieces: list[tuple[int, list[int], int, bool]], prefill: bool = False) -> np.ndarray:
        """One llama_decode of (seq_id, tokens, first position, wants logits) pieces; the logits of each wanting
        piece's last token, [wanting, vocab] float32 (numpy: torch is only for the rows that sample). prefill:
        the pieces are prompts' tokens (the expert counter counts every such step, a sample of the decode ones)."""
        batch, n = self.batch, 0
        wanted = []
        for seq_id, tokens, start, logits in pieces:
            for j, token in enumerate(tokens):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, start + j, 1
                batch.seq_id[n][0] = seq_id
                last = logits and j == len(tokens) - 1
                batch.logits[n] = last
                if last:
                    wanted.append(n)
                n += 1
        batch.n_tokens = n
        if self.counter is not None:
            self.counter.begin_step(prefill)
        quiet_debug(True)  # ggml-cuda's debug line per CUDA graph replayed stops in C, not at the GIL
        try:
            code = self.api.llama_decode(self.ctx, batch)
        finally:
            quiet_debug(False)
        if code != 0:
            raise MoedeskError(f"llama.cpp could not decode a batch of {n} tokens: "
                               f"{_DECODE_ERRORS.get(code, f'error {code}')}")
        rows = np.empty((len(wanted), self.n_vocab), dtype=np.float32)
        for i, index in enumerate(wanted):
            pointer = self.api.llama_get_logits_ith(self.ctx, index)
            if not pointer:  # NULL: llama.cpp has no logits for that token (its log says why)
                raise MoedeskError(f"llama.cpp gave no logits for token {index} of a batch of {n}")
            rows[i] = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
        return rows

    def close(self) -> None:
        if self.ctx is not None:
            self.api.llama_free(self.ctx)
            self.ctx = None
        if self.batch is not None:
            self.api.llama_batch_free(self.batch)
            self.batch = None


class _NoExperts:
    """The native decoder reads expert statistics from its executor; llama.cpp keeps none per step."""


class LlamaCppDecoder(Decoder):
    def __init__(self, context: LlamaContext, tokenizer, context_length: int, eos_token_ids=(),
                 experts_per_token: tuple[int, int] = (0, 0)):
        """experts_per_token: (on the GPU, in RAM) routed experts one token runs, from the placement: llama.cpp
        computes a layer's experts where its tensors are, so each finished request's stats say where they ran."""
        self.context = context  # llama.cpp's KV cache and batch
        self.experts_per_token = experts_per_token
        stops = frozenset(eos_token_ids) | (tokenizer.eos_token_ids if tokenizer is not None else frozenset())
        # llama.cpp runs the forwards in its own cache: of the native runner only the device logits come back on,
        # the context and the stop set are used.
        super().__init__(ModelRunner(None, "cpu", None, context_length, stops), _NoExperts(), tokenizer)

    def start(self, request: Request, row: int) -> Sequence:
        if len(request.prompt_ids) >= self.context_length:
            raise MoedeskError(f"prompt has {len(request.prompt_ids)} tokens; the context is {self.context_length}")
        if not request.prompt_ids:
            raise MoedeskError("a request needs a prompt of at least one token")
        if row >= self.context.slots:
            raise MoedeskError(f"row {row} beyond the llama.cpp context's {self.context.slots} sequences")
        seq = super().start(request, row)
        self.context.forget(row)  # the row's previous request
        return seq

    def reserve(self, rows: int, seqs: list[Sequence]) -> None:
        """Nothing to grow: each sequence has its context's cells from the start."""

    def prefill(self, seqs: list[Sequence], budget: int | None = None) -> Iterator[tuple[Sequence, int | None]]:
        left = self.context.batch_tokens if budget is None else min(budget, self.context.batch_tokens)
        pieces, done = [], []
        for s in seqs:
            take = min(len(s.request.prompt_ids) - s.prefilled, left)
            if take <= 0:
                continue
            left -= take
            ends = s.prefilled + take == len(s.request.prompt_ids)
            pieces.append((s.row, s.request.prompt_ids[s.prefilled:s.prefilled + take], s.prefilled, ends))
            s.prefilled += take
            if ends:
                s.position = s.prefilled
                done.append(s)
        if not pieces:
            return
        logits = self.context.run(pieces, prefill=True)
        if done:
            yield from self._accept(done, logits)

    def decode(self, seqs: list[Sequence]) -> Iterator[tuple[Sequence, int | None]]:
        logits = self.context.run([(s.row, [s.tokens[-1]], s.position, True) for s in seqs])
        for s in seqs:
            s.position += 1
        yield from self._accept(seqs, logits)

    def _accept(self, seqs, logits: np.ndarray, picked=None) -> Iterator[tuple[Sequence, int | None]]:
        if all(greedy_unconstrained(s) for s in seqs):
            # No torch op between two llama_decode calls: a torch CPU op may start its OpenMP team (several rows
            # do), whose threads then spin beside llama.cpp's own on the cores its experts need.
            return super()._accept(seqs, logits, picked=dict(enumerate(greedy_tokens(logits))))
        return super()._accept(seqs, torch.from_numpy(logits))

    def completion(self, s: Sequence):
        done = super().completion(s)
        gpu, cpu = self.experts_per_token
        if gpu or cpu:
            steps = len(s.tokens)
            done.stats["experts"] = {"experts_gpu": gpu * steps, "experts_cpu": cpu * steps,
                                     "gpu_hit_rate": gpu / (gpu + cpu)}
        return done


def greedy_unconstrained(s: Sequence) -> bool:
    """Whether `s` takes the argmax of its logits with no grammar: numpy alone chooses its token."""
    return s.params.temperature == 0 and s.constraint is None


def greedy_tokens(logits: np.ndarray) -> list[int]:
    """Each row's argmax ([rows, vocab]), single-threaded; a tie or NaN picks the first, as torch.argmax does."""
    return np.argmax(logits, axis=-1).tolist()
