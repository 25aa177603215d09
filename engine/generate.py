"""The decoding loop: continuous batching over cache slots, stop conditions, streaming text.

Up to `batch_size` sequences decode together, one cache row each. When a sequence finishes,
its row takes the next request at once; new requests are prefilled together, right-padded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from engine.errors import MoedeskError
from engine.requests import Completion, Request
from engine.sampling import sample_token


@dataclass
class Sequence:
    request: Request
    row: int
    position: int = 0  # where the next token's key/value goes
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    started: float = 0.0
    first_token_at: float = 0.0
    expert_stats_at_start: object = None  # a copy of the executor's StepStats when the sequence began
    detokenizer: object = None  # the tokenizer's StreamDecoder: `text` grows by a token's text, not re-decoded

    @property
    def params(self):
        return self.request.params


class Decoder:
    """Runs requests through a model and cache. Tokenizer is optional (prompt_ids-only models)."""

    def __init__(self, model, cache, executor, tokenizer, context_length: int, eos_token_ids=(), on_oom=None,
                 graphs=None):
        """on_oom() is called when the GPU runs out of memory in a step: it frees memory (moves experts
        off the GPU) and returns True to retry the step, or False to give up (the error propagates).
        graphs: an engine.cuda_graphs.GraphedDecode for the same model and cache, or None (eager decode)."""
        self.model, self.cache, self.executor = model, cache, executor
        self.graphs = graphs
        self.on_oom = on_oom
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.eos_token_ids = frozenset(eos_token_ids) | (tokenizer.eos_token_ids if tokenizer else frozenset())
        self.device = cache.device

    def run(self, requests: Iterable[Request], batch_size: int, cancel=None) -> Iterator[tuple[Sequence, int | None]]:
        """Yield (sequence, new token) each time a sequence grows; token None when it finished without one.

        A sequence is finished when its `finish_reason` is set; the caller sees that event last.
        """
        pending = iter(requests)
        slots: list[Sequence | None] = [None] * batch_size
        exhausted = False
        while True:
            free = [row for row, s in enumerate(slots) if s is None]
            fresh = []
            while free and not exhausted:
                request = next(pending, None)
                if request is None:
                    exhausted = True
                    break
                seq = Sequence(request, free.pop(0), started=time.perf_counter(),
                               detokenizer=self.tokenizer.stream_decoder() if self.tokenizer else None)
                if hasattr(self.executor, "stats"):
                    seq.expert_stats_at_start = self.executor.stats.copy()
                if request.params.temperature > 0:
                    seq.generator = torch.Generator().manual_seed(request.params.seed)
                slots[seq.row] = seq
                fresh.append(seq)
            if fresh:
                yield from self._prefill(fresh, slots)
            active = [s for s in slots if s is not None]
            if not active:
                return
            if cancel is not None and cancel.is_set():
                for seq in active:
                    seq.finish_reason = "cancelled"
                    slots[seq.row] = None
                    yield seq, None
                return
            yield from self._decode(active, slots)

    def _prefill(self, seqs: list[Sequence], slots) -> Iterator[tuple[Sequence, int | None]]:
        lengths = [len(s.request.prompt_ids) for s in seqs]
        longest = max(lengths)
        need = max(min(self.context_length, n + s.params.max_new_tokens) for n, s in zip(lengths, seqs))
        self._retrying_oom(lambda: self.cache.ensure(len(slots), need))
        tokens = torch.zeros(len(seqs), longest, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : lengths[i]] = torch.tensor(s.request.prompt_ids)
        # Padding continues each row's positions, so it lands past the row's end in the cache
        # where the row's own later tokens overwrite it before anything can attend to it.
        positions = torch.arange(longest).expand(len(seqs), -1)
        rows = torch.tensor([s.row for s in seqs])
        logits = self._retrying_oom(lambda: self.model(
            tokens.to(self.device), positions.to(self.device), self.cache, self.executor,
            rows=rows.to(self.device), logits_at=torch.tensor(lengths, device=self.device) - 1))
        for s, n in zip(seqs, lengths):
            s.position = n
        yield from self._accept(seqs, logits[:, -1], slots)

    def _decode(self, seqs: list[Sequence], slots) -> Iterator[tuple[Sequence, int | None]]:
        tokens = torch.tensor([[s.tokens[-1]] for s in seqs])
        positions = torch.tensor([[s.position] for s in seqs])
        rows = None if [s.row for s in seqs] == list(range(len(seqs))) else torch.tensor([s.row for s in seqs])
        logits = self._retrying_oom(lambda: self._step(tokens.to(self.device), positions.to(self.device),
                                                       None if rows is None else rows.to(self.device)))
        for s in seqs:
            s.position += 1
        yield from self._accept(seqs, logits[:, -1], slots)

    def _step(self, tokens, positions, rows):
        logits = self.graphs.decode(tokens, positions, self.executor, rows) if self.graphs is not None else None
        if logits is None:
            logits = self.model(tokens, positions, self.cache, self.executor, rows=rows)
        return logits

    def _retrying_oom(self, step):
        """Run step(); after a GPU out-of-memory error let on_oom free memory and run it again.

        A step may run twice: it writes the same keys and values at the same positions, so
        the retry computes what the first attempt would have.
        """
        while True:
            try:
                return step()
            except torch.OutOfMemoryError as error:
                if self.on_oom is None or not self.on_oom():
                    raise MoedeskError("GPU out of memory with nothing left to move to RAM: "
                                       "use a shorter context or a smaller batch") from error

    def _accept(self, seqs, logits: torch.Tensor, slots) -> Iterator[tuple[Sequence, int | None]]:
        greedy = torch.argmax(logits, dim=-1).tolist()
        cpu_logits = None
        now = time.perf_counter()
        for i, s in enumerate(seqs):
            if s.params.temperature == 0:
                token = greedy[i]
            else:
                cpu_logits = logits.cpu() if cpu_logits is None else cpu_logits
                token = sample_token(cpu_logits[i], s.params, s.generator)
            if not s.tokens:
                s.first_token_at = now
            if token in self.eos_token_ids and not s.params.ignore_eos:
                s.finish_reason = "stop"
                slots[s.row] = None
                yield s, None
                continue
            s.tokens.append(token)
            added = s.detokenizer.step(token) if s.detokenizer is not None else ""
            s.text += added
            self._check_stop(s, len(added))
            if s.finish_reason:
                slots[s.row] = None
            yield s, token

    def _check_stop(self, s: Sequence, added: int) -> None:
        """added: characters the last token appended to s.text. Earlier text held no stop string, so only
        an occurrence ending in those characters can be new: the search starts where the longest could."""
        if s.params.stop and s.detokenizer is not None:
            start = max(0, len(s.text) - added - max(map(len, s.params.stop)) + 1)
            cut = min((i for i in (s.text.find(stop, start) for stop in s.params.stop) if i >= 0), default=-1)
            if cut >= 0:
                s.text = s.text[:cut]
                s.finish_reason = "stop"
                return
        if len(s.tokens) >= s.params.max_new_tokens or s.position >= self.context_length:
            s.finish_reason = "length"

    def completion(self, s: Sequence) -> Completion:
        if self.tokenizer is not None and not (s.params.stop and s.finish_reason == "stop"):
            s.text = self.tokenizer.decode(s.tokens)
        end = time.perf_counter()
        decode_time = end - s.first_token_at if s.first_token_at else 0.0
        stats = {
            "ttft_s": round(s.first_token_at - s.started, 4) if s.first_token_at else None,
            "decode_tok_s": round((len(s.tokens) - 1) / decode_time, 2) if len(s.tokens) > 1 and decode_time > 0 else None,
            "total_s": round(end - s.started, 4),
        }
        if s.expert_stats_at_start is not None:
            # Steps are shared: these count the expert work of every step this sequence took part in.
            stats["experts"] = self.executor.stats.since(s.expert_stats_at_start).as_dict()
        return Completion(tag=s.request.tag, token_ids=list(s.tokens), text=s.text, finish_reason=s.finish_reason,
                          prompt_tokens=len(s.request.prompt_ids), stats=stats)
