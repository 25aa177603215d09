"""Beam search: W hypotheses decoded as one batch, scored and stopped as Hugging Face transformers does.

Every step runs the W running hypotheses through the model as one batch of W tokens, so the
expert executor sees all of them at once: an expert in RAM that several hypotheses pick is read
once for all of them (Fiddler's beam-search scenario). The hypotheses live in W rows of a KV cache
of their own; the prompt is prefilled once into row 0, and the first step's reordering copies it
to the other rows. After each step the surviving hypotheses' rows are gathered on the device with
one index per layer and no trip through the host.

Scoring and stopping follow `generate(num_beams=W, do_sample=False)` of transformers (its
`_beam_search`): log-softmax scores summed; at each step the best (1 + number of EOS ids, at
least 2) * W continuations of all hypotheses are taken; a continuation that ends (an EOS token,
or the last allowed token) is a finished candidate only if it ranks among the first W, with the
score sum / length ** length_penalty, length counting the generated tokens and the EOS; the W best
finished hypotheses are kept; the W best continuations that did not end run on. The search stops
when it cannot improve the best finished hypotheses (transformers' heuristic, which early_stopping
False, True and "never" parametrise the same way), when every one of the W finished slots is
filled and early_stopping is True, or when no continuation can go on. The small bookkeeping of
each step (2W scores) is done with the same torch operations on the host, so ties break alike.

`BeamSearch.steps` is the search as a generator of one forward per `next`; `run` drives it to the end,
and `BeamJob` is the scheduler's job that steps it on the decode thread between the plain batch's steps
(engine.generation.scheduler), so a search never waits for other requests and never stops them.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.errors import MoedeskError
from engine.generation.decoder import retrying_oom, synchronize
from engine.generation.kv_cache import KVCache
from engine.requests import Completion

_NEG = -1.0e9  # what transformers adds to rule a candidate out; the same value keeps ties and order alike


@dataclass
class BeamResult:
    """The best finished hypothesis: its tokens (with the EOS it ended on, if any) and how the search went."""

    tokens: list[int]
    score: float  # sum of log-probabilities / length ** length_penalty
    ended_by_eos: bool
    steps: int  # forwards of the W hypotheses (decode steps), the prefill not counted
    prefill_s: float
    decode_s: float  # from the prefill's end to the search's: the steps with their choosing and reordering


def check_options(beams: int, length_penalty: float, early_stopping) -> None:
    """Raise ValueError (one line) for options beam search cannot take."""
    if isinstance(beams, bool) or not isinstance(beams, int) or beams < 1:
        raise ValueError(f"beams must be an integer >= 1, got {beams!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) or \
            not float("-inf") < length_penalty < float("inf"):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be true, false or \"never\", got {early_stopping!r}")


@dataclass(frozen=True)
class BeamOptions:
    """A request decoded by beam search (Engine.submit's `decoding`): `beams` hypotheses, transformers'
    length_penalty and early_stopping. The request's max_new_tokens and ignore_eos apply; its sampling does not."""

    beams: int = 4
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        check_options(self.beams, self.length_penalty, self.early_stopping)


class BeamSearch:
    """Beam search over one model. Holds the hypotheses' KV cache (and CUDA graphs over it) between
    searches, grown as a search needs, so a run of searches allocates and captures once.

    One search at a time: a search holds a lock from its first step to its last. Its forwards must not
    overlap another thread's use of the same executor: the engine runs it on its decode thread (BeamJob).
    """

    def __init__(self, model, device, dtype, context_length: int, on_oom=None, graphs: bool = False):
        """on_oom() frees GPU memory after an out-of-memory error and returns True to retry (as for
        engine.generation.decoder.Decoder). graphs: replay decode steps from CUDA graphs over this cache."""
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.context_length = context_length
        self.on_oom = on_oom
        self.use_graphs = graphs
        self.cache: KVCache | None = None
        self.graphs = None
        self._lock = threading.Lock()

    def run(self, prompt_ids: list[int], executor, beams: int, max_new_tokens: int, eos_token_ids=(),
            length_penalty: float = 1.0, early_stopping=False) -> BeamResult:
        """Search `beams` hypotheses continuing `prompt_ids` for at most `max_new_tokens` tokens (fewer when
        the context ends first); return the best. eos_token_ids: tokens that end a hypothesis."""
        steps = self.steps(prompt_ids, executor, beams, max_new_tokens, eos_token_ids, length_penalty, early_stopping)
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value

    def steps(self, prompt_ids: list[int], executor, beams: int, max_new_tokens: int, eos_token_ids=(),
              length_penalty: float = 1.0, early_stopping=False):
        """`run` as a generator: each `next` runs one forward (the prompt's, then one per step) and the search's
        bookkeeping; its StopIteration carries the BeamResult. Options are checked here, before anything runs.
        Closing it early ends the search and lets the next one start."""
        check_options(beams, length_penalty, early_stopping)
        if not prompt_ids:
            raise ValueError("beam search needs a prompt of at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if len(prompt_ids) >= self.context_length:
            raise MoedeskError(f"prompt has {len(prompt_ids)} tokens; the context is {self.context_length}")
        max_new_tokens = min(max_new_tokens, self.context_length - len(prompt_ids))
        return self._locked(self._search(list(prompt_ids), executor, beams, max_new_tokens, frozenset(eos_token_ids),
                                         float(length_penalty), early_stopping))

    def _locked(self, search):
        with self._lock:
            return (yield from search)

    # --- the search ---------------------------------------------------------------------------

    def _search(self, prompt, executor, W, max_new, eos, length_penalty, early_stopping):
        P = len(prompt)
        max_length = P + max_new
        self.reserve(W, max_length)
        started = time.perf_counter()
        logits = self._retrying(lambda: self.model(
            torch.tensor([prompt], device=self.device), torch.arange(P, device=self.device)[None], self.cache,
            executor, logits_at=torch.tensor([P - 1], device=self.device)))
        synchronize(self.device)
        decode_started = time.perf_counter()
        prefill_s = decode_started - started
        yield

        keep = max(2, 1 + len(eos)) * W  # enough that W continuations survive even when the best all end
        top_w = torch.arange(keep) < W  # only the first W continuations may become finished hypotheses
        # Hypothesis 0 alone is live at first: the others are copies of it, and would offer the same tokens.
        running_scores = torch.full((W,), _NEG, device=self.device)
        running_scores[0] = 0.0
        running: list[list[int]] = [[] for _ in range(W)]  # generated tokens of each running hypothesis
        finished: list[list[int] | None] = [None] * W
        finished_scores = torch.full((W,), _NEG)
        finished_done = torch.zeros(W, dtype=torch.bool)
        can_improve = True
        step_logits = logits[:, -1].expand(W, -1)
        steps = 0
        first = True
        while True:
            vocab = step_logits.shape[-1]
            totals = torch.log_softmax(step_logits, dim=-1) + running_scores[:, None]
            values, indices = torch.topk(totals.reshape(-1), keep)
            # The one host round trip of a step: 2W scores and indices.
            values, indices = values.cpu(), indices.cpu()
            source, tokens = indices // vocab, indices % vocab
            generated = len(running[0]) + 1  # tokens a continuation of this step holds, its last one included
            token_list = tokens.tolist()
            ends = torch.tensor([t in eos for t in token_list], dtype=torch.bool) | (P + generated >= max_length)
            candidates = [running[s] + [t] for s, t in zip(source.tolist(), token_list)]

            # The W best continuations that go on (those that ended are pushed below every other).
            live_scores = values + ends.to(torch.float32) * _NEG
            live = torch.topk(live_scores, k=W)[1]
            next_scores = live_scores[live]

            # Finished hypotheses: the ended ones among the first W continuations, if they beat what is kept.
            just_ended = ends & top_w
            scores = values / (generated ** length_penalty)
            scores += float(bool(finished_done.all()) and early_stopping is True) * _NEG
            scores += float(not can_improve) * _NEG
            scores += (~just_ended) * _NEG
            merged_scores = torch.cat((finished_scores, scores))
            merged_done = torch.cat((finished_done, just_ended))
            best = torch.topk(merged_scores, k=W)[1]
            merged = finished + candidates
            finished = [merged[i] for i in best.tolist()]
            finished_scores, finished_done = merged_scores[best], merged_done[best]

            live_list = live.tolist()
            rows = [0] * W if first else [source[i].item() for i in live_list]
            running = [candidates[i] for i in live_list]
            running_scores = next_scores.to(self.device)
            first = False

            # Can a running hypothesis still beat the worst finished one? (transformers' heuristic: with
            # early_stopping "never" and a positive penalty, assume it could run to the longest length.)
            best_length = max_new if early_stopping == "never" and length_penalty > 0 else generated
            best_possible = next_scores[:1] / (best_length ** length_penalty)
            worst_finished = torch.where(finished_done, torch.min(finished_scores), _NEG)
            can_improve = can_improve and bool(torch.any(best_possible > worst_finished))
            if not can_improve or (bool(finished_done.all()) and early_stopping is True) or bool(ends.all()):
                break

            self._reorder(rows, P + generated - 1)
            step_tokens = torch.tensor([[h[-1]] for h in running], device=self.device)
            positions = torch.full((W, 1), P + generated - 1, dtype=torch.long, device=self.device)
            step_logits = self._retrying(lambda: self._step(step_tokens, positions, executor))[:, -1]
            steps += 1
            yield

        tokens = finished[0] if finished[0] is not None else running[0]
        return BeamResult(tokens=list(tokens), score=float(finished_scores[0]),
                          ended_by_eos=bool(tokens) and tokens[-1] in eos, steps=steps, prefill_s=prefill_s,
                          decode_s=time.perf_counter() - decode_started)

    # --- the device side ----------------------------------------------------------------------

    def reserve(self, rows: int, length: int) -> None:
        """Room for `rows` hypotheses of `length` tokens, prompt included (a search does this itself; a caller
        may do it first so that a short warm-up captures the CUDA graphs of the cache a longer search uses)."""
        # The last token chosen is never fed back: its position needs no room.
        length = min(length - 1, self.context_length)
        if self.cache is None:
            self.cache = self._retrying(lambda: KVCache(self.model.cfg, rows, length, self.dtype, self.device))
            if self.use_graphs:
                from engine.generation.cuda_graphs import GraphedDecode

                self.graphs = GraphedDecode(self.model, self.cache)
        else:
            # Reallocating moves the tensors; the graphs see that (their cache key) and capture again.
            self._retrying(lambda: self.cache.ensure(rows, length))

    def _reorder(self, rows: list[int], length: int) -> None:
        """Hypothesis j continues what row rows[j] holds: gather the first `length` positions of those rows."""
        if rows == list(range(len(rows))):
            return
        index = torch.tensor(rows, device=self.device)
        W = len(rows)
        for t in self.cache.k + self.cache.v:
            t[:W, :length] = t[:W, :length].index_select(0, index)

    def _step(self, tokens, positions, executor):
        logits = self.graphs.decode(tokens, positions, executor) if self.graphs is not None else None
        if logits is None:
            logits = self.model(tokens, positions, self.cache, executor)
        return logits

    def _retrying(self, step):
        return retrying_oom(step, self.on_oom, "use fewer beams or fewer new tokens")



class BeamJob:
    """The scheduler's job for beam-search requests (engine.generation.scheduler.Job): one search at a time,
    since the engine keeps one BeamSearch (one hypotheses' cache, one set of CUDA graphs), so a second request
    waits for the first to end rather than allocating a second cache of W rows. Nothing streams before the
    end: until then no hypothesis is final, so the last update carries the best one whole.

    search() gives the engine's BeamSearch (made on first use, on the decode thread); executor() the engine's
    current executor; eos() the ids that end a hypothesis (the request's ignore_eos aside)."""

    def __init__(self, search: Callable[[], BeamSearch], executor: Callable[[], object], tokenizer,
                 eos: Callable[[], set]):
        self.search, self.executor, self.tokenizer, self.eos = search, executor, tokenizer, eos
        self.plain: list = []
        self.waiting: list = []  # admitted, not yet started
        self.current = None  # (handle, steps generator, started, expert stats before)

    def admit(self, handle) -> None:
        options = handle.kind.options
        check_options(options.beams, options.length_penalty, options.early_stopping)
        if len(handle.request.prompt_ids) >= self.search().context_length:
            raise MoedeskError(f"prompt has {len(handle.request.prompt_ids)} tokens; the context is "
                               f"{self.search().context_length}")
        self.waiting.append(handle)

    def step(self):
        if self.current is None:
            if not self.waiting:
                return []
            handle = self.waiting.pop(0)
            options, params = handle.kind.options, handle.request.params
            executor = self.executor()
            eos = set() if params.ignore_eos else self.eos()
            steps = self.search().steps(handle.request.prompt_ids, executor, options.beams, params.max_new_tokens, eos,
                                        options.length_penalty, options.early_stopping)
            before = executor.stats.copy() if hasattr(executor, "stats") else None
            self.current = (handle, steps, time.perf_counter(), before, executor)
        handle, steps, started, before, executor = self.current
        try:
            next(steps)
            return []
        except StopIteration as end:
            self.current = None
            return [(handle, None, "", self._completion(handle, end.value, started, before, executor))]

    def _completion(self, handle, result: BeamResult, started: float, before, executor) -> Completion:
        options = handle.kind.options
        tokens = result.tokens[:-1] if result.ended_by_eos else result.tokens
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        # Between its steps the decode thread also steps the plain batch and other jobs: under load these
        # times include theirs.
        stats = {
            "ttft_s": round(result.prefill_s, 4),  # the prompt's forward: no token is final before the end
            "decode_tok_s": round(len(tokens) / result.decode_s, 2) if result.decode_s > 0 and tokens else None,
            "total_s": round(time.perf_counter() - started, 4),
            "beams": options.beams, "beam_steps": result.steps,
            "beam_step_ms": round(1000 * result.decode_s / result.steps, 3) if result.steps else None,
            "score": round(result.score, 6),
        }
        if before is not None:
            stats["experts"] = executor.stats.since(before).as_dict()
        return Completion(tag=handle.request.tag, token_ids=tokens, text=text,
                          finish_reason="stop" if result.ended_by_eos else "length",
                          prompt_tokens=len(handle.request.prompt_ids), stats=stats)

    def drop(self, handle) -> Completion:
        if self.current is not None and self.current[0] is handle:
            self.current[1].close()  # ends the search, so the next one may start
            self.current = None
        elif handle in self.waiting:
            self.waiting.remove(handle)
        # Nothing was streamed, and no hypothesis is final before the end: the reply is empty.
        return Completion(tag=handle.request.tag, token_ids=[], text="", finish_reason="cancelled",
                          prompt_tokens=len(handle.request.prompt_ids), stats={"beams": handle.kind.options.beams})

    def close(self) -> None:
        if self.current is not None:
            self.current[1].close()
            self.current = None


class BeamKind:
    """engine.generation.scheduler.JobKind for beam search: one job for all beam requests, one request at a time."""

    key = "beam"
    limit = 1

    def __init__(self, options: BeamOptions, make: Callable[[], BeamJob]):
        self.options, self._make = options, make

    def make(self) -> BeamJob:
        return self._make()
