"""Speculative decoding as the engine runs it: a job of the scheduler's decode thread (`SpeculativeJob`, one per
draft configuration, `SpeculativeKind`) that admits requests as they arrive and steps a SpeculativeBatch
between the plain batch's steps; and the entry points that submit speculative requests to an engine.
"""
from __future__ import annotations

from moedesk.engine.requests import Completion, Request
from moedesk.engine.speculative.auto import RunningCosts, auto_decodes_plainly, carried_counts, learn_acceptance
from moedesk.engine.speculative.eagle_drafter import draft_head, eagle_factory
from moedesk.engine.speculative.options import SpeculativeOptions
from moedesk.engine.speculative.step_times import cached_step_times, engine_step_times, graphs_like
from moedesk.engine.speculative.verification import SpeculativeBatch, Speculator, check_request


def speculate(engine, requests: list[Request], draft, mode: str = "greedy", draft_length: int = 4,
              draft_width: int = 4, budget: int | None = None) -> list[Completion]:
    """Complete `requests` together with speculative decoding (Engine.speculate documents it): submitted to the
    engine's scheduler at once, so they verify as one batch, beside whatever else it runs."""
    options = SpeculativeOptions(mode, draft, draft_length, draft_width, budget)
    if not requests:
        return []
    return engine.complete(requests, decoding=options)


def generate_speculative(engine, requests, batch_size: int, draft, mode: str = "greedy", draft_length: int = 4,
                         draft_width: int = 4, budget: int | None = None):
    """Engine.generate's interface with speculative decoding: at most `batch_size` requests in the speculative
    batch at once, a finished one's row taken by the next (continuous batching, as plain generate does), each
    completion yielded as it finishes."""
    return engine.generate(requests, batch_size=batch_size,
                           decoding=SpeculativeOptions(mode, draft, draft_length, draft_width, budget))


SPECULATIVE_ROWS = 16  # requests one speculative job holds when the caller sets no limit (as a group would)


class SpeculativeKind:
    """engine.generation.scheduler.JobKind for speculative requests: one job per draft configuration, holding
    up to `limit` requests that join and leave between its rounds."""

    def __init__(self, engine, options: SpeculativeOptions, limit: int = SPECULATIVE_ROWS):
        self.engine, self.options, self.limit = engine, options, max(1, limit)
        self.key = options.key

    def make(self) -> "SpeculativeJob":
        return SpeculativeJob(self.engine, self.options, self.limit)


class SpeculativeJob:
    """Speculative requests of one configuration, stepped by the scheduler's decode thread
    (engine.generation.scheduler.Job): each step prefills the newcomers together and runs one round over
    every running request, whose accepted tokens then stream one by one, as plain decoding's do.

    The draft head is loaded, auto's step times measured (cached per machine) and a Speculator (its KV cache)
    taken from the engine's idle ones at the first step, on the decode thread. In auto mode, requests that
    start a job go back to the plain batch when not even a good draft would pay at their batch size, or their run
    is too short to afford a probe (auto_decodes_plainly): decoding them plainly is never slower."""

    def __init__(self, engine, options: SpeculativeOptions, limit: int):
        self.engine, self.options, self.limit = engine, options, limit
        self.plain: list = []
        self.fresh: list = []
        self.rows: dict = {}  # handle -> _Row, in admission order
        self.batch: SpeculativeBatch | None = None
        self.spec: Speculator | None = None
        self.decided = options.mode != "auto"  # whether drafting can pay here was decided
        self.measured_rows = 0  # the largest batch auto's step times were measured for

    def admit(self, handle) -> None:
        check_request(handle.request, self.engine.context_length)
        self.fresh.append(handle)

    def _start(self, first: list) -> None:
        engine, o = self.engine, self.options
        factory = o.draft if callable(o.draft) else eagle_factory(draft_head(engine, o.draft), engine.config.num_layers)
        costs = self._measured_costs(len(first)) if o.mode == "auto" else None
        idle = engine.idle_speculators
        self.spec = idle.pop() if idle else Speculator(engine.model, engine.device, engine.dtype,
                                                       engine.context_length, engine.config.eos_token_ids,
                                                       engine.tokenizer, on_oom=engine._on_oom,
                                                       can_free=engine._can_free,
                                                       graphs=graphs_like(engine.graphs))
        self.spec.runner.stop_ids = engine.runner.stop_ids
        room = (o.draft_length + 1) * o.width + 8
        # As a run sizes it for its requests, capped at a context's worth: rows come and go, so the drafter
        # compacts and grows its slots as it needs (EagleDrafter.grow) instead of holding a worst case.
        capacity = min(max(len(h.request.prompt_ids) for h in first)
                       + (o.draft_length + 1) * max(h.request.params.max_new_tokens for h in first),
                       engine.context_length) + room

        def drafter(batch, capacity_):
            made = factory(batch, capacity_)
            if hasattr(made, "draft_room"):
                made.draft_room = room
            return made

        self.batch = SpeculativeBatch(self.spec, drafter, o.mode, o.draft_length, o.width, o.budget, costs, capacity,
                                      self._known_acceptance())

    def _measured_costs(self, rows: int, earlier: RunningCosts | None = None) -> RunningCosts:
        """Step times for batches up to `rows` (rounded up to a power of two, within the job's limit): what the rows
        at hand need, so a lone chat's first reply waits for one batch size's timing, not for every size up to the
        limit; a batch that outgrows them has them measured then (`_grow_costs`). earlier: costs whose run-time
        corrections the new ones keep."""
        gamma = self.options.draft_length
        table = cached_step_times(self.engine, self.limit, gamma)  # every size, where measured before (the app does)
        if table is not None:
            self.measured_rows = self.limit
        else:
            self.measured_rows = min(self.limit, 1 << max(0, rows - 1).bit_length())
            table = engine_step_times(self.engine, self.measured_rows, gamma)
        costs = RunningCosts(table)
        return costs if earlier is None else costs.keeping(earlier)

    def _grow_costs(self) -> None:
        if self.batch.costs is not None and len(self.batch.active()) > self.measured_rows:
            self.batch.costs = self._measured_costs(len(self.batch.active()), self.batch.costs)

    def _acceptance_key(self):
        draft = self.options.draft
        return draft if callable(draft) else str(draft)

    def _known_acceptance(self) -> tuple[float, float]:
        """(accepted, tested) drafts of this draft in the engine's earlier requests, as carried_counts keeps them."""
        return getattr(self.engine, "acceptance", {}).get(self._acceptance_key(), (0, 0))

    def step(self):
        engine = self.engine
        fresh, self.fresh = self.fresh, []
        if fresh and self.batch is None:
            self._start(fresh)
        if fresh and not self.decided:
            self.decided = True
            o = self.options
            horizon = max(h.request.params.max_new_tokens for h in fresh)
            known = self._known_acceptance()
            if auto_decodes_plainly(self.batch.costs, len(fresh), o.draft_length, horizon, known):
                for handle in fresh:
                    handle.extra_stats["speculative"] = {"mode": "auto", "plain": True}
                self.plain.extend(fresh)
                # Their plain steps (at most `horizon`) fade what earlier requests measured, as a run's plain rounds
                # do (learn_acceptance): after a few such requests the next one probes the draft again. close()
                # keeps the faded counts for the engine.
                self.batch.alpha_counts = list(learn_acceptance(known, 0, 0, horizon))
                return []
        executor = engine.executor
        if fresh:
            for handle, row in zip(fresh, self.batch.admit([h.request for h in fresh], executor, streamed=True)):
                self.rows[handle] = row
            self._grow_costs()
        if self.batch is not None and self.batch.active():
            self.batch.round(executor)
        return self._events(executor)

    def _events(self, executor) -> list:
        events = []
        for handle, row in list(self.rows.items()):
            for token, text in row.streamed:
                events.append((handle, token, text, None))
            row.streamed.clear()
            if row.finish_reason is not None:
                events.append((handle, None, row.text, self._finish(handle, executor)))
        return events

    def _finish(self, handle, executor) -> Completion:
        row = self.rows.pop(handle)
        done = self.batch.completion(row, executor)
        self.batch.release(row)
        return done

    def drop(self, handle) -> Completion:
        if handle in self.fresh:
            self.fresh.remove(handle)
        row = self.rows.get(handle)
        if row is None:
            return Completion(tag=handle.request.tag, token_ids=[], text="", finish_reason="cancelled",
                              prompt_tokens=len(handle.request.prompt_ids), stats={})
        row.finish_reason = "cancelled"
        return self._finish(handle, self.engine.executor)

    def close(self) -> None:
        if (self.batch is not None and self.options.mode == "auto" and self.batch.alpha_counts[1]
                and hasattr(self.engine, "acceptance")):
            # What this job learnt of the draft's acceptance starts the next job's estimate.
            self.engine.acceptance[self._acceptance_key()] = carried_counts(*self.batch.alpha_counts)
        if self.spec is not None:
            self.engine.idle_speculators.append(self.spec)
            self.spec = None

