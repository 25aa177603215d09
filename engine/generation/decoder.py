"""The decoding loop: continuous batching over cache slots, stop conditions, streaming text.

Up to `batch_size` sequences decode together, one cache row each. When a sequence finishes,
its row takes the next request at once; new requests are prefilled together, right-padded.
`Decoder.start`, `prefill` and `decode` are the steps; `Decoder.run` drives them over an
iterable of requests, engine.generation.scheduler.Scheduler over requests that arrive while it runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from moedesk.engine.requests import Completion, Request
from moedesk.engine.generation.runner import ModelRunner
from moedesk.engine.generation.sampling import sample_token, sample_tokens


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
    prefilled: int = 0  # prompt tokens already in the cache (a long prompt may prefill in pieces)
    constraint: object = None  # engine.generation.sampling.TokenConstraint when the request has a grammar

    @property
    def params(self):
        return self.request.params


class Decoder:
    """Runs requests through a runner's model and cache (engine.generation.runner.ModelRunner: its CUDA graphs,
    out-of-memory retry and stop set). Tokenizer is optional (prompt_ids-only models)."""

    def __init__(self, runner: ModelRunner, executor, tokenizer):
        self.runner, self.executor, self.tokenizer = runner, executor, tokenizer
        self.context_length = runner.context_length
        self.eos_token_ids = runner.stop_ids
        self.device = runner.device

    def run(self, requests: Iterable[Request], batch_size: int, cancel=None) -> Iterator[tuple[Sequence, int | None]]:
        """Yield (sequence, new token) each time a sequence grows; token None when it finished without one.

        A sequence is finished when its `finish_reason` is set; the caller sees that event last.
        The simplest driver of `start`/`prefill`/`decode` (engine.generation.scheduler.Scheduler is the other):
        prompts prefill whole, and a freed row takes the next request at once.
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
                seq = self.start(request, free.pop(0))
                slots[seq.row] = seq
                fresh.append(seq)
            if fresh:
                self.reserve(len(slots), fresh)
                yield from _freeing(self.prefill(fresh), slots)
            active = [s for s in slots if s is not None]
            if not active:
                return
            if cancel is not None and cancel.is_set():
                for seq in active:
                    seq.finish_reason = "cancelled"
                    slots[seq.row] = None
                    yield seq, None
                return
            yield from _freeing(self.decode(active), slots)

    def start(self, request: Request, row: int) -> Sequence:
        """A new sequence for `request` in cache row `row` (nothing computed yet)."""
        seq = Sequence(request, row, started=time.perf_counter(),
                       detokenizer=self.tokenizer.stream_decoder() if self.tokenizer else None)
        if hasattr(self.executor, "stats"):
            seq.expert_stats_at_start = self.executor.stats.copy()
        if request.params.temperature > 0:
            seq.generator = torch.Generator().manual_seed(request.params.seed)
        if request.grammar is not None:
            if request.fed_tokens:
                raise ValueError("a request takes fed tokens or a grammar, not both")
            seq.constraint = request.grammar.matcher()
        return seq

    def reserve(self, rows: int, seqs: list[Sequence]) -> None:
        """Grow the cache to `rows` rows, long enough for every one of `seqs` to run to its end."""
        need = max(min(self.context_length, len(s.request.prompt_ids) + s.params.max_new_tokens) for s in seqs)
        self.runner.reserve(rows, need)

    def prefill(self, seqs: list[Sequence], budget: int | None = None) -> Iterator[tuple[Sequence, int | None]]:
        """One forward over the next piece of each sequence's prompt, at most `budget` prompt tokens in all
        (None: the whole prompts). A sequence whose prompt is then complete gets its first token.
        Sequences the budget leaves no room for are not touched (`Sequence.prefilled` says how far each got)."""
        pieces = []
        left = budget
        for s in seqs:
            take = len(s.request.prompt_ids) - s.prefilled
            if left is not None:
                take = min(take, left)
                left -= take
            if take > 0:
                pieces.append((s, take))
        if not pieces:
            return
        longest = max(take for _, take in pieces)
        tokens = torch.zeros(len(pieces), longest, dtype=torch.long)
        for i, (s, take) in enumerate(pieces):
            tokens[i, :take] = torch.tensor(s.request.prompt_ids[s.prefilled:s.prefilled + take])
        # Padding continues each row's positions, so it lands past the row's end in the cache where the row's
        # own later tokens overwrite it before anything can attend to it. Clamped to the last position of the
        # context: a prompt is shorter than the context, so no real token of the row sits there.
        starts = torch.tensor([s.prefilled for s, _ in pieces])
        positions = (starts[:, None] + torch.arange(longest)).clamp(max=self.context_length - 1)
        rows = torch.tensor([s.row for s, _ in pieces])
        self.runner.reserve(self.runner.cache.rows, int(positions.max()) + 1)
        takes = torch.tensor([take for _, take in pieces])
        logits = self.runner.prefill(tokens.to(self.device), positions.to(self.device), self.executor,
                                     rows=rows.to(self.device), logits_at=takes.to(self.device) - 1)
        done, done_logits = [], []
        for i, (s, take) in enumerate(pieces):
            s.prefilled += take
            if s.prefilled == len(s.request.prompt_ids):
                s.position = s.prefilled
                done.append(s)
                done_logits.append(i)
        if done:
            yield from self._accept(done, logits[done_logits, -1])

    def decode(self, seqs: list[Sequence]) -> Iterator[tuple[Sequence, int | None]]:
        """One decode step of `seqs` (each with its prompt prefilled and a last token)."""
        tokens = torch.tensor([[s.tokens[-1]] for s in seqs])
        positions = torch.tensor([[s.position] for s in seqs])
        rows = None if [s.row for s in seqs] == list(range(len(seqs))) else torch.tensor([s.row for s in seqs])
        logits = self.runner.step(tokens.to(self.device), positions.to(self.device), self.executor,
                                  None if rows is None else rows.to(self.device))
        for s in seqs:
            s.position += 1
        yield from self._accept(seqs, logits[:, -1])

    def _accept(self, seqs, logits: torch.Tensor, picked: dict[int, int] | None = None
                ) -> Iterator[tuple[Sequence, int | None]]:
        """picked: the token of each unconstrained row, where the caller chose them already (None: chosen here)."""
        if picked is None:
            # Every unconstrained row at once, on the logits' device: greedy rows take the argmax, sampled ones
            # their own draw (sample_tokens).
            free = [i for i, s in enumerate(seqs) if s.constraint is None]
            picked = dict(zip(free, sample_tokens(logits[free] if len(free) < len(seqs) else logits,
                                                  [seqs[i].params for i in free], [seqs[i].generator for i in free])))
        now = time.perf_counter()
        for i, s in enumerate(seqs):
            if s.constraint is not None:
                # Only constrained sequences pay for a mask: one row to the host, the grammar's tokens kept.
                row = s.constraint.mask(logits[i].float().cpu())
                token = int(torch.argmax(row)) if s.params.temperature == 0 else sample_token(row, s.params, s.generator)
            else:
                token = picked[i]
            if len(s.tokens) < len(s.request.fed_tokens):
                # Chosen (the step's work is a real one's) and then replaced: what the next step reads is the fed one.
                token = s.request.fed_tokens[len(s.tokens)]
            if not s.tokens:
                s.first_token_at = now
            if token in self.eos_token_ids and (not s.params.ignore_eos or s.constraint is not None):
                s.finish_reason = "stop" if s.constraint is None or s.constraint.complete() else "length"
                yield s, None
                continue
            s.tokens.append(token)
            added = s.detokenizer.step(token) if s.detokenizer is not None else ""
            s.text += added
            self._check_stop(s, len(added))
            if s.constraint is not None and s.constraint.accept(token) and not s.finish_reason:
                # nothing but the end may follow: a complete match stops, a failed grammar ends as `length`
                s.finish_reason = "stop" if s.constraint.complete() else "length"
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
        # s.position is where the newest token would go: prompt + reply fill the context when it reaches its end.
        if len(s.tokens) >= s.params.max_new_tokens or s.position + 1 >= self.context_length:
            s.finish_reason = "length"

    def completion(self, s: Sequence) -> Completion:
        """The finished sequence as the caller gets it (decodes the whole text once)."""
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


def _freeing(events, slots) -> Iterator[tuple[Sequence, int | None]]:
    """Pass events on, emptying a finished sequence's slot before its caller sees the event."""
    for seq, token in events:
        if seq.finish_reason:
            slots[seq.row] = None
        yield seq, token


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (timings); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
