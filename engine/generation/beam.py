"""Beam search: W hypotheses decoded as one batch, scored and stopped as Hugging Face transformers does.

Every step runs the W running hypotheses through the model as one batch of W tokens, so the
expert executor sees all of them at once: an expert in RAM that several hypotheses pick is read
once for all of them (Fiddler's beam-search scenario). The hypotheses live in W rows of a KV cache
of their own; the prompt is prefilled once into the first of them, and the first step's reordering
copies it to the others. After each step the surviving hypotheses' rows are gathered on the device with
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

Several searches step together: each holds a block of W cache rows, and one forward per step runs every
block (MoE decode with experts in RAM is memory-bound, so a forward over more rows costs little more than
over W). A search's reordering stays inside its block and rows never see each other, so each search gives
what it gives alone. Searches that end free their rows, and waiting ones are admitted (their prompts
prefilled) between steps. `BeamSearch.step` is one such step; `run` adds a search and steps until it ends,
and `BeamJob` is the scheduler's job that steps them on the decode thread between the plain batch's steps
(engine.generation.scheduler), so a search never waits for other requests and never stops them.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from moedesk.engine.errors import MoedeskError
from moedesk.engine.generation.decoder import synchronize
from moedesk.engine.generation.runner import ModelRunner
from moedesk.engine.requests import Completion

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
    mean_rows: float | None = None  # rows (the hypotheses of every search stepping with it) per step, on average


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


# Cache rows that the searches stepping together may hold at once (the sum of their widths). A decode forward over
# experts in RAM is memory-bound: more rows cost little more than W, up to the batch where most experts are picked
# every step anyway (the GPU box measured batched decode to B = 32, docs/measurements.md). 64 rows take four searches
# of the server's widest (16 beams) or sixteen of 4, while the cache they need stays about 64 prompt+reply lengths. A
# search wider than this still runs, alone.
BEAM_ROWS = 64


class _Search:
    """One search's state between steps: its options, its block of cache rows and its hypotheses."""

    def __init__(self, prompt: list[int], W: int, max_new: int, eos: frozenset, length_penalty: float,
                 early_stopping):
        self.prompt, self.W, self.max_new, self.eos = prompt, W, max_new, eos
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.P = len(prompt)
        self.max_length = self.P + max_new
        self.rows: list[int] = []  # its block: the cache rows of its W hypotheses, set when it is admitted
        self.logits = None  # [W, vocab]: the last forward's, waiting to be chosen from
        self.result: BeamResult | None = None
        self.steps = 0
        self.rows_sum = 0  # rows of the forwards it took part in, summed (all searches' hypotheses)
        self.added = time.perf_counter()
        self.prefill_s = 0.0
        self.decode_started = 0.0
        self.keep = max(2, 1 + len(eos)) * W  # enough that W continuations survive even when the best all end
        self.top_w = torch.arange(self.keep) < W  # only the first W continuations may become finished hypotheses
        self.running: list[list[int]] = [[] for _ in range(W)]  # generated tokens of each running hypothesis
        self.finished: list[list[int] | None] = [None] * W
        self.finished_scores = torch.full((W,), _NEG)
        self.finished_done = torch.zeros(W, dtype=torch.bool)
        self.can_improve = True
        self.first = True
        self.running_scores = None  # on the device, set at the prefill
        self.source: list[int] = []  # after choosing: hypothesis j continues what block row source[j] holds
        self.position = 0  # after choosing: the position the next tokens take

    def prefilled(self, logits, device) -> None:
        # Hypothesis 0 alone is live at first: the others are copies of it, and would offer the same tokens.
        self.running_scores = torch.full((self.W,), _NEG, device=device)
        self.running_scores[0] = 0.0
        self.logits = logits[:, -1].expand(self.W, -1)

    def choose(self, device) -> bool:
        """One step's bookkeeping on `logits`, as transformers' `_beam_search` does it: True when the search ends
        (`result` set), else `source`, `position` and `running` say what the next forward feeds."""
        W, eos, length_penalty, early_stopping = self.W, self.eos, self.length_penalty, self.early_stopping
        step_logits = self.logits
        vocab = step_logits.shape[-1]
        totals = torch.log_softmax(step_logits, dim=-1) + self.running_scores[:, None]
        values, indices = torch.topk(totals.reshape(-1), self.keep)
        # The one host round trip of a step: 2W scores and indices.
        values, indices = values.cpu(), indices.cpu()
        source, tokens = indices // vocab, indices % vocab
        generated = len(self.running[0]) + 1  # tokens a continuation of this step holds, its last one included
        token_list = tokens.tolist()
        ends = torch.tensor([t in eos for t in token_list], dtype=torch.bool) | (self.P + generated >= self.max_length)
        candidates = [self.running[s] + [t] for s, t in zip(source.tolist(), token_list)]

        # The W best continuations that go on (those that ended are pushed below every other).
        live_scores = values + ends.to(torch.float32) * _NEG
        live = torch.topk(live_scores, k=W)[1]
        next_scores = live_scores[live]

        # Finished hypotheses: the ended ones among the first W continuations, if they beat what is kept.
        just_ended = ends & self.top_w
        scores = values / (generated ** length_penalty)
        scores += float(bool(self.finished_done.all()) and early_stopping is True) * _NEG
        scores += float(not self.can_improve) * _NEG
        scores += (~just_ended) * _NEG
        merged_scores = torch.cat((self.finished_scores, scores))
        merged_done = torch.cat((self.finished_done, just_ended))
        best = torch.topk(merged_scores, k=W)[1]
        merged = self.finished + candidates
        self.finished = [merged[i] for i in best.tolist()]
        self.finished_scores, self.finished_done = merged_scores[best], merged_done[best]

        live_list = live.tolist()
        self.source = [0] * W if self.first else [source[i].item() for i in live_list]
        self.running = [candidates[i] for i in live_list]
        self.running_scores = next_scores.to(device)
        self.first = False

        # Can a running hypothesis still beat the worst finished one? (transformers' heuristic: with
        # early_stopping "never" and a positive penalty, assume it could run to the longest length.)
        best_length = self.max_new if early_stopping == "never" and length_penalty > 0 else generated
        best_possible = next_scores[:1] / (best_length ** length_penalty)
        worst_finished = torch.where(self.finished_done, torch.min(self.finished_scores), _NEG)
        self.can_improve = self.can_improve and bool(torch.any(best_possible > worst_finished))
        if not self.can_improve or (bool(self.finished_done.all()) and early_stopping is True) or bool(ends.all()):
            tokens = self.finished[0] if self.finished[0] is not None else self.running[0]
            self.result = BeamResult(tokens=list(tokens), score=float(self.finished_scores[0]),
                                     ended_by_eos=bool(tokens) and tokens[-1] in eos, steps=self.steps,
                                     prefill_s=self.prefill_s, decode_s=time.perf_counter() - self.decode_started,
                                     mean_rows=round(self.rows_sum / self.steps, 3) if self.steps else None)
            return True
        self.position = self.P + generated - 1
        return False


class BeamSearch:
    """Beam search over one model, several searches at once. Its runner (engine.generation.runner) holds the
    hypotheses' cache and the CUDA graphs over it between searches, grown as the searches need, so a run of
    searches allocates and captures once.

    Each admitted search owns a block of W cache rows; a `step` runs one forward over every block (the rows of
    all searches, one token each), and a search's reordering (its best W hypotheses) gathers rows inside its own
    block. Rows never see each other, so a search gives what it gives alone. Searches that end free their rows;
    waiting ones are admitted between steps, in the order they were added, while their rows fit in `max_rows`
    (their prompts prefilled into their first row, one forward each).

    Its forwards must not overlap another thread's use of the same executor: the engine steps it on its decode
    thread (BeamJob). A lock keeps two threads from stepping it at once.
    """

    def __init__(self, model, device, dtype, context_length: int, on_oom=None, graphs: bool = False,
                 max_rows: int = BEAM_ROWS, can_free=None):
        """on_oom() frees GPU memory after an out-of-memory error and returns True to retry (as for
        engine.generation.decoder.Decoder). graphs: replay decode steps from CUDA graphs over this cache (keyed
        by the rows of all searches together). max_rows: hypotheses of all searches stepping together.
        can_free: as ModelRunner's."""
        self.model, self.device = model, torch.device(device)
        self.context_length = context_length
        self.runner = ModelRunner(model, device, dtype, context_length, on_oom=on_oom, graphs=graphs,
                                  advice="use fewer beams or fewer new tokens", can_free=can_free)
        self.max_rows = max_rows
        self.waiting: list[_Search] = []  # added, not yet admitted
        self.active: list[_Search] = []  # admitted: holding rows, in the order they were admitted
        self.counters = dict(forwards=0, prefills=0, rows_sum=0, max_rows=0)  # decode forwards and their rows
        self._lock = threading.RLock()

    def run(self, prompt_ids: list[int], executor, beams: int, max_new_tokens: int, eos_token_ids=(),
            length_penalty: float = 1.0, early_stopping=False) -> BeamResult:
        """Search `beams` hypotheses continuing `prompt_ids` for at most `max_new_tokens` tokens (fewer when
        the context ends first); return the best. eos_token_ids: tokens that end a hypothesis. Searches added
        and not ended step alongside."""
        search = self.add(prompt_ids, beams, max_new_tokens, eos_token_ids, length_penalty, early_stopping)
        try:
            while search.result is None:
                self.step(executor)
        finally:
            self.remove(search)
        return search.result

    def add(self, prompt_ids: list[int], beams: int, max_new_tokens: int, eos_token_ids=(),
            length_penalty: float = 1.0, early_stopping=False) -> _Search:
        """Queue a search (options checked here, before anything runs); `step` admits it when its rows fit and
        sets its `result` at the step it ends on."""
        check_options(beams, length_penalty, early_stopping)
        if not prompt_ids:
            raise ValueError("beam search needs a prompt of at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if len(prompt_ids) >= self.context_length:
            raise MoedeskError(f"prompt has {len(prompt_ids)} tokens; the context is {self.context_length}")
        max_new_tokens = min(max_new_tokens, self.context_length - len(prompt_ids))
        search = _Search(list(prompt_ids), beams, max_new_tokens, frozenset(eos_token_ids), float(length_penalty),
                         early_stopping)
        with self._lock:
            self.waiting.append(search)
        return search

    def remove(self, search: _Search) -> None:
        """Forget a search, ended or not (a cancel), and free its rows for the others."""
        with self._lock:
            if search in self.waiting:
                self.waiting.remove(search)
            if search in self.active:
                self.active.remove(search)
            search.rows = []

    # --- a step -------------------------------------------------------------------------------

    def step(self, executor) -> list[_Search]:
        """Admit the waiting searches that fit (a prefill forward each), choose every admitted search's next
        hypotheses, and run one forward over the blocks of those that go on. Returns the searches that ended
        at this step (their `result` set, their rows freed; they are no longer held)."""
        with self._lock:
            self._admit(executor)
            ended = []
            for search in list(self.active):
                if search.logits is not None and search.choose(self.device):
                    self.active.remove(search)
                    search.rows = []
                    ended.append(search)
            going = [s for s in self.active if s.logits is not None]
            if going:
                self._forward(going, executor)
            return ended

    def _admit(self, executor) -> None:
        while self.waiting:
            search = self.waiting[0]
            used = sorted(r for s in self.active for r in s.rows)
            if self.active and len(used) + search.W > self.max_rows:
                return  # in order: a wide search is not passed over for ever by narrower ones behind it
            taken, free = set(used), []
            row = 0
            while len(free) < search.W:
                if row not in taken:
                    free.append(row)
                row += 1
            started = time.perf_counter()
            self.reserve(free[-1] + 1, search.max_length)
            self.waiting.pop(0)
            search.rows = free
            self.active.append(search)
            P = search.P
            rows = None if free[0] == 0 else torch.tensor([free[0]], device=self.device)
            logits = self.runner.prefill(torch.tensor([search.prompt], device=self.device),
                                         torch.arange(P, device=self.device)[None], executor, rows=rows,
                                         logits_at=torch.tensor([P - 1], device=self.device))
            synchronize(self.device)
            search.decode_started = time.perf_counter()
            search.prefill_s = search.decode_started - started
            search.prefilled(logits, self.device)
            self.counters["prefills"] += 1

    def _forward(self, going: list[_Search], executor) -> None:
        for search in going:
            # Hypothesis j continues what the block's row source[j] holds, inside the block.
            self.runner.fork(search.rows, search.source, search.position)
        rows = [r for s in going for r in s.rows]
        tokens = torch.tensor([[h[-1]] for s in going for h in s.running], device=self.device)
        positions = torch.tensor([[s.position] for s in going for _ in range(s.W)], device=self.device)
        # Rows 0..N-1 in order need no index (as one search alone has them); else each token names its row.
        index = None if rows == list(range(len(rows))) else torch.tensor(rows, device=self.device)
        logits = self.runner.step(tokens, positions, executor, index)[:, -1]
        at = 0
        for search in going:
            search.logits = logits[at:at + search.W]
            at += search.W
            search.steps += 1
            search.rows_sum += len(rows)
        self.counters["forwards"] += 1
        self.counters["rows_sum"] += len(rows)
        self.counters["max_rows"] = max(self.counters["max_rows"], len(rows))

    # --- the device side ----------------------------------------------------------------------

    def reserve(self, rows: int, length: int) -> None:
        """Room for `rows` hypotheses of `length` tokens, prompt included (a search does this itself; a caller
        may do it first so that a short warm-up captures the CUDA graphs of the cache a longer search uses)."""
        # The last token chosen is never fed back: its position needs no room.
        self.runner.reserve(rows, min(length - 1, self.context_length))


class BeamJob:
    """The scheduler's job for beam-search requests (engine.generation.scheduler.Job): every beam request of the
    engine goes to one job, whose searches step together in the engine's one BeamSearch (one forward over all
    their rows per step, up to its max_rows; beyond that a request waits in it for rows to free). Nothing
    streams before the end: until then no hypothesis is final, so the last update carries the best one whole.

    search() gives the engine's BeamSearch (made on first use, on the decode thread); executor() the engine's
    current executor; eos() the ids that end a hypothesis (the request's ignore_eos aside)."""

    def __init__(self, search: Callable[[], BeamSearch], executor: Callable[[], object], tokenizer,
                 eos: Callable[[], set]):
        self.search, self.executor, self.tokenizer, self.eos = search, executor, tokenizer, eos
        self.plain: list = []
        self.held: dict = {}  # handle -> (its search, started, expert stats before)

    def admit(self, handle) -> None:
        options, params = handle.kind.options, handle.request.params
        eos = set() if params.ignore_eos else self.eos()
        search = self.search().add(handle.request.prompt_ids, options.beams, params.max_new_tokens, eos,
                                   options.length_penalty, options.early_stopping)
        executor = self.executor()
        before = executor.stats.copy() if hasattr(executor, "stats") else None
        self.held[handle] = (search, time.perf_counter(), before, executor)

    def step(self):
        ended = {id(s) for s in self.search().step(self.executor())}
        events = []
        for handle, (search, started, before, executor) in list(self.held.items()):
            if id(search) in ended:
                del self.held[handle]
                events.append((handle, None, "", self._completion(handle, search.result, started, before, executor)))
        return events

    def _completion(self, handle, result: BeamResult, started: float, before, executor) -> Completion:
        options = handle.kind.options
        tokens = result.tokens[:-1] if result.ended_by_eos else result.tokens
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        # Between its steps the decode thread also steps the plain batch and other jobs, and its forwards carry
        # the other searches' rows: under load these times (and the expert counts) include theirs.
        stats = {
            "ttft_s": round(result.prefill_s, 4),  # the prompt's forward: no token is final before the end
            "decode_tok_s": round(len(tokens) / result.decode_s, 2) if result.decode_s > 0 and tokens else None,
            "total_s": round(time.perf_counter() - started, 4),
            "beams": options.beams, "beam_steps": result.steps,
            "beam_step_ms": round(1000 * result.decode_s / result.steps, 3) if result.steps else None,
            "mean_rows": result.mean_rows,  # hypotheses of every search in its steps' forwards, on average
            "score": round(result.score, 6),
        }
        if before is not None:
            stats["experts"] = executor.stats.since(before).as_dict()
        return Completion(tag=handle.request.tag, token_ids=tokens, text=text,
                          finish_reason="stop" if result.ended_by_eos else "length",
                          prompt_tokens=len(handle.request.prompt_ids), stats=stats)

    def drop(self, handle) -> Completion:
        held = self.held.pop(handle, None)
        if held is not None:
            self.search().remove(held[0])  # its rows go to the others and to waiting searches
        # Nothing was streamed, and no hypothesis is final before the end: the reply is empty.
        return Completion(tag=handle.request.tag, token_ids=[], text="", finish_reason="cancelled",
                          prompt_tokens=len(handle.request.prompt_ids), stats={"beams": handle.kind.options.beams})

    def close(self) -> None:
        for search, *_ in self.held.values():
            self.search().remove(search)
        self.held.clear()


class BeamKind:
    """engine.generation.scheduler.JobKind for beam search: one job for all beam requests, whose searches step
    together. Each search takes at least one of BeamSearch's rows, so more requests than it has rows could not
    step together anyway: those wait in the scheduler's queue; the job holds back those whose rows do not fit."""

    key = "beam"
    limit = BEAM_ROWS

    def __init__(self, options: BeamOptions, make: Callable[[], BeamJob]):
        self.options, self._make = options, make

    def make(self) -> BeamJob:
        return self._make()
