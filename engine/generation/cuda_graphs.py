"""Decode steps replayed from CUDA graphs: the GPU work between two MoE layers' experts, one graph each.

Eager decode launches every small kernel of attention, norms and router from Python, which took more of a
Qwen3 step than its experts on the CPU (docs/measurements.md, "Decoding: graphs, sampling, the scheduler").
The work from one layer's experts to the next layer's routing is the same every step of a batch size, so it is
captured once and replayed. The experts stay outside the graphs where the executor needs the routing on the host
to decide afresh each step; a layer whose experts all live on the GPU (the executor's
`runs_on_device`) is captured whole, so it costs no round trip through the host. Each graph
ends by copying its routing (tokens and expert ids) to pinned host memory, and the next one
begins by weighting and summing the expert outputs the executor left in a fixed device
buffer: between two replays the host only waits for that copy, runs the experts, and queues
their outputs' copy back. At batch 1 the GPU may compute some of those experts itself, from
their pinned host copies, while the host runs the others (a small graph of its own per layer).
Where no layer needs a host decision (one token per step), the whole step is one graph instead, which hands
each layer's routing to the host and waits on the GPU for its results through flags in pinned memory
(kernels/host_handoff.py), computing the layer's resident experts itself meanwhile: the host launches
nothing between layers, where its launches were a share of every layer's time (same section).
A graph needs fixed shapes, so attention reads the cache's whole allocated length and the mask
hides what is past each row's position.

Recurrent layers (Gated DeltaNet) replay too: each reads its rows' matrix and convolution states from the cache's
tensors and writes them back in place (engine.model.cache.recurrent), a verify forward's per-token states into the
kept ones, so replaying is feeding the tokens. That is why a new shape's eager warm-up is that call's result rather
than followed by a replay: a state, unlike a KV cache entry, would take the tokens twice.

The same segments run k tokens per row: a speculative verify forward (engine.speculative.verification) scores a
chain of γ drafts (k = γ + 1, the causal mask built from the positions inside the graph) or a draft tree of
a fixed node count (its mask over the cache and the slots its nodes write are inputs too). The host-run
experts between segments see all k tokens of all rows in one call, as in the eager forward.

Captured per (batch size, tokens per row, explicit cache rows or not, tree or not, features returned), again
when the cache is reallocated or the executor or its placement changes (the graphs read the resident experts'
weights). One token per row is captured at once (a decode step repeats); more only once a shape recurs and
while fewer than `max_shapes` are held, since speculative shapes vary with the draft length and the rows
running, and a capture costs an eager step plus graph memory.
"""
from __future__ import annotations

import logging
import os
from functools import partial

import torch

from moedesk.engine.model.cache.kv import KVCache
from moedesk.engine.graph_capture import capturing
from moedesk.engine.model.transformer import ForwardBatch, Transformer
from moedesk.engine.offload.expert_executor import HostRouting
from moedesk.kernels.host_handoff import Handoff, handoff_wanted

log = logging.getLogger("moedesk")


def graphs_wanted(device: torch.device) -> bool:
    """CUDA graphs for decode: on CUDA, unless MOEDESK_NO_CUDA_GRAPHS is set."""
    disabled = os.environ.get("MOEDESK_NO_CUDA_GRAPHS", "").strip().lower() not in ("", "0", "false", "no")
    return device.type == "cuda" and not disabled


class GraphedDecode:
    """`forward(tokens, positions, executor, rows)` → logits [B, T, vocab], as `Transformer.forward` gives them,
    for one token per row (a decode step) or k (speculative verification); an engine.generation.runner.ModelRunner
    calls it and runs the forward eagerly where it returns None."""

    def __init__(self, model: Transformer, cache: KVCache, capture: bool = True, capture_after: int = 2,
                 max_shapes: int = 32):
        """capture=False runs the same segments eagerly, on any device: how CI checks the split and the
        fixed-length attention that the graphs replay. capture_after: sightings of a multi-token shape before
        it is captured (before that it runs eagerly, the caller's forward); max_shapes: multi-token shapes held."""
        self.model, self.cache, self.capture = model, cache, capture
        self.capture_after, self.max_shapes = capture_after, max_shapes
        self.captured: dict[tuple, _Captured] = {}
        self.seen: dict[tuple, int] = {}
        self.pool = None  # one memory pool for every graph
        self.broken: str | None = None  # why capturing failed; decode is eager from then on
        self.captures = 0  # shapes captured (set up, with capture=False) so far: a timing can leave those out
        # Forwards left eager because their multi-token shape was seen fewer than capture_after times: a new
        # shape's one-off cost too (eager runs every kernel launch from Python, several replays' worth), not what the
        # shape costs once it recurs.
        self.warmups = 0

    def release(self) -> None:
        """Drop every captured graph and the memory it holds now (a caller done with this cache)."""
        for captured in self.captured.values():
            captured.release()
        self.captured, self.seen, self.pool = {}, {}, None

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, executor, rows: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, slots: torch.Tensor | None = None, features: tuple = ()):
        """`Transformer.forward` of tokens [B, T] at positions [B, T] (every position's logits), or None when the
        caller must run it eagerly (graphs broken, or a multi-token shape not captured). mask [B, 1, T, L] and
        slots [B, T] as the model takes them, for a tree; L may be shorter than the cache (the rest is hidden).
        features: as the model's, then (logits, {feature: [B, T, H]})."""
        if self.broken is not None:
            return None
        if mask is not None and mask.shape[-1] > self.cache.length:
            return None
        batch, length = tokens.shape
        features = tuple(features)
        key = (batch, length, rows is not None, mask is not None, features)
        captured = self.captured.get(key)
        if captured is None or captured.stale(self.cache, executor):
            if captured is None and length > 1:
                self.seen[key] = self.seen.get(key, 0) + 1
                held = sum(1 for k in self.captured if k[1] > 1)
                if self.seen[key] < self.capture_after:
                    self.warmups += 1
                    return None
                if held >= self.max_shapes:
                    return None
            # Graphs of other shapes captured before the same change are stale too: drop them all, with
            # the memory they hold. Released here, not whenever the garbage collector gets to them: a graph
            # freed in the middle of another's capture into the same pool trips the caching allocator's
            # pool accounting (an INTERNAL ASSERT on use_count, seen on the H100 box), and a capture that
            # fails that way leaves the CUDA generator refusing every later random op.
            stale = {k for k, c in self.captured.items() if c.stale(self.cache, executor)}
            for k in stale:
                self.captured.pop(k).release()
            if not self.captured:
                self.pool = None  # its graphs are gone; a fresh capture starts a fresh pool
            captured = _Captured(self.model, self.cache, batch, length, rows is not None, mask is not None,
                                 features, executor)
            # The new shape's step runs once eagerly (warming its kernels up) and that run is this call's result:
            # replaying on top of it would feed the tokens twice to a recurrent state, which, unlike a KV cache's
            # entries, is not simply overwritten.
            self.captures += 1
            result = captured.warm_up(tokens, positions, rows, mask, slots, executor)
            try:
                if self.capture:
                    captured.capture(executor, self.pool)
            except RuntimeError as e:
                captured.release()
                if isinstance(e, torch.OutOfMemoryError):
                    if not getattr(self.cache, "stateful", False):
                        raise  # the decoder frees memory and runs the step again: a KV cache takes it twice unchanged
                    # A recurrent state has taken the step already: it is done; the next one tries capturing again.
                    log.warning("out of memory capturing CUDA graphs for %d x %d tokens: this step ran eagerly",
                                batch, length)
                    return result
                self.broken = str(e).splitlines()[0] if str(e) else type(e).__name__
                log.warning("CUDA graphs off, decoding eagerly: %s", self.broken)
                return result
            self.pool = captured.pool
            self.captured[key] = captured
            return result
        return captured.replay(tokens, positions, rows, mask, slots, executor)


class _Captured:
    """The graphs of one shape: segment 0 runs embedding to the routing of the first MoE layer
    whose experts need the host, segment j from the j-th such layer's residual to the next one's
    routing, the last to the logits."""

    def __init__(self, model: Transformer, cache: KVCache, batch: int, length: int, with_rows: bool, tree: bool,
                 features: tuple, executor):
        self.model, self.cache = model, cache
        self.cache_key = _cache_key(cache, executor)
        device = cache.device
        self.tokens = torch.zeros(batch, length, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, length, dtype=torch.long, device=device)
        self.rows = torch.arange(batch, device=device) if with_rows else None
        # A tree's nodes see their ancestors, not what precedes them in the slots: the mask (over the cache's
        # whole length, as the graphs read it) and the slots come from the caller.
        self.mask = torch.zeros(batch, 1, length, cache.length, dtype=torch.bool, device=device) if tree else None
        self.slots = torch.zeros(batch, length, dtype=torch.long, device=device) if tree else None
        self.features = features
        self.hidden: dict = {}  # feature -> its static tensor, written by the segment that computes it
        tokens = batch * length
        on_device = getattr(executor, "runs_on_device", lambda layer: False)
        self.moe_at = [i for i, block in enumerate(model.layers) if hasattr(block, "moe") and not on_device(block.moe.layer)]
        self.on_device = _OnDevice(executor)  # what the captured MoE layers' experts run through
        dtype, hidden, top_k = model.embed.weight.dtype, model.cfg.hidden_size, model.cfg.num_experts_per_tok
        # The executor writes each MoE layer's expert outputs here and the next segment reads them.
        self.expert_out = torch.zeros(tokens * top_k, hidden, dtype=dtype, device=device)
        self.host: HostRouting | None = None  # where captured segments leave the routing for the host
        if device.type == "cuda" and self.moe_at:
            self.host = HostRouting(torch.zeros(tokens, hidden, dtype=dtype, pin_memory=True),
                                    torch.zeros(tokens, top_k, dtype=torch.long, pin_memory=True), torch.cuda.Event())
        # Per host-run MoE layer: how many of the token's last ranks the GPU computes from RAM itself while
        # the host runs the rest (engine.offload.offload_executor.OffloadExecutor.zero_copy_share), in a graph of its own
        # replayed after the host's copy of the routing is queued, so the host need not wait for it.
        share = getattr(executor, "zero_copy_share", None)
        self.zero_copy = [share(model.layers[i].moe.layer, tokens, top_k) if share and self.host else 0
                         for i in self.moe_at]
        # Or how many of every expert's first rows the host computes, the GPU the rest into `split_out`, which
        # the next segment adds (OffloadExecutor.width_split); 0: none.
        split = getattr(executor, "width_split", None)
        self.cpu_width = [split(model.layers[i].moe.layer, tokens, top_k) if split and self.host else 0
                         for i in self.moe_at]
        self.split_out = torch.zeros(tokens * top_k, hidden, dtype=torch.float32, device=device) \
            if any(self.cpu_width) else None
        # Where no host-run layer needs a host decision, the step is one graph that hands each layer to the
        # host and back through flags (kernels.host_handoff): nothing is launched between layers.
        self.handoff: Handoff | None = None
        self.host_plans: list = []  # per host-run layer, the host's side of a handed-over step (`_plan_host_shares`)
        host_only = getattr(executor, "host_only", None)
        if (self.host is not None and host_only is not None and handoff_wanted()
                and all(host_only(model.layers[i].moe.layer, tokens, top_k) for i in self.moe_at)):
            self.handoff = Handoff(len(self.moe_at), device)
            self.host_out = torch.zeros(tokens * top_k, hidden, dtype=dtype, pin_memory=True)
        self.zero_copy_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: list = []  # per segment: (x, flat, weights, ids), the last: logits
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.pool = None

    def stale(self, cache: KVCache, executor) -> bool:
        return _cache_key(cache, executor) != self.cache_key

    def release(self) -> None:
        """Free the graphs and their outputs now."""
        for graph in [*self.graphs, *self.zero_copy_graphs.values()]:
            graph.reset()
        self.graphs, self.zero_copy_graphs, self.outputs, self.hidden, self.host_plans = [], {}, [], {}, []

    def _segment(self, j: int, to_host: bool = True):
        """Segment j's work; to_host: end by queueing the copy of its routing to the host (False: the handoff's
        signal copies it)."""
        model, cache = self.model, self.cache
        blocks = model.layers
        if j == 0:
            # Several tokens a row are a verify forward: recurrent layers keep each token's state for `accept`.
            self.forward_batch = ForwardBatch(self.positions, self.rows, self.on_device, kv_len=cache.length,
                                              mask=self.mask, slots=self.slots,
                                              keep_states=self.tokens.shape[1] > 1)
            x, self.rope = model.embed_tokens(self.tokens, self.positions)
            start = 0
        else:
            prev = self.moe_at[j - 1]
            x_prev, flat_prev, weights, _ = self.outputs[j - 1]
            y = self.expert_out
            if self.cpu_width[j - 1]:  # the host's rows of each expert plus the GPU's
                y = (y.float() + self.split_out).to(y.dtype)
            x = blocks[prev].after_experts(x_prev, flat_prev, blocks[prev].moe.combine(y, weights))
            start = prev + 1
        end = self.moe_at[j] if j < len(self.moe_at) else len(blocks)
        # Dense layers, and MoE layers run on the device alone: the model's own layer loop.
        x = model.run_layers(x, self.rope, cache, self.forward_batch, start, end, self.features, self.hidden)
        if j == len(self.moe_at):
            return model.head(x, self.features, self.hidden)
        if end in self.features:
            self.hidden[end] = x
        x, flat, weights, ids = blocks[end].before_experts(x, self.rope, cache, self.forward_batch)
        if self.host is not None and to_host:
            self.host.x.copy_(flat, non_blocking=True)
            self.host.ids.copy_(ids, non_blocking=True)
        return x, flat, weights, ids

    def _experts(self, j: int, executor, cuda_stream) -> None:
        _, flat, _, ids = self.outputs[j]
        moe = self.model.layers[self.moe_at[j]].moe
        if self.host is not None:
            # The step's stream, looked up once per step: Event.record() without one asks torch for the current
            # stream, host time paid again at every layer.
            self.host.ready.record(cuda_stream)
            self.host.zero_copy, self.host.cpu_width = self.zero_copy[j], self.cpu_width[j]
            if self.zero_copy[j] or self.cpu_width[j]:
                graph = self.zero_copy_graphs.get(j)
                if graph is not None:
                    graph.replay()
                else:
                    self._zero_copy_share(j, executor, moe, flat, ids)
        executor.expert_outputs(moe, flat, ids, out=self.expert_out, host=self.host)

    def _zero_copy_share(self, j: int, executor, moe, flat, ids) -> None:
        """Queue the GPU's share of host-run MoE layer j read from RAM: whole experts or every expert's last rows."""
        if self.zero_copy[j]:
            executor.zero_copy_experts(moe, flat, ids, self.zero_copy[j], self.expert_out)
        else:
            executor.zero_copy_width(moe, flat, ids, self.cpu_width[j], self.split_out)

    def _hand_over(self, j: int, executor) -> None:
        """Captured after segment j: the routing to the host, the GPU's own share, and once the host is done
        its results into `expert_out`."""
        _, flat, _, ids = self.outputs[j]
        moe = self.model.layers[self.moe_at[j]].moe
        self.handoff.signal(j, (flat, self.host.x), (ids, self.host.ids))
        resident = executor.device_share(moe, flat, ids) if executor.has_resident(moe.layer) else None
        if self.zero_copy[j] or self.cpu_width[j]:
            self._zero_copy_share(j, executor, moe, flat, ids)
        rows = self.host_out.shape[0] - self.zero_copy[j]
        self.handoff.wait(j, self.host_out[:rows], self.expert_out[:rows])
        if resident is not None:
            y, mask = resident
            self.expert_out.copy_(torch.where(mask[:, None], y, self.expert_out))

    def _plan_host_shares(self, executor) -> None:
        """The host's side of each handed-over layer, prepared once per capture (the executor's `host_plan`, where
        it has one): the same buffers every step, the layer's flag as `ready`."""
        plan = getattr(executor, "host_plan", None)
        self.host_plans = []
        for j, i in enumerate(self.moe_at):
            host = HostRouting(self.host.x, self.host.ids, self.handoff.ready(j), self.zero_copy[j], self.cpu_width[j])
            moe = self.model.layers[i].moe
            self.host_plans.append(plan(moe, host, self.host_out) if plan is not None
                                   else partial(executor.host_share, moe, host, self.host_out))

    def _host_shares(self) -> None:
        """The host's side of a handed-over step: each layer's experts as the graph reaches its routing."""
        handoff = self.handoff
        try:
            for j, share in enumerate(self.host_plans):
                share()
                handoff.host_done(j)
        except BaseException:
            handoff.release()  # the GPU goes on with wrong results; the caller gets the error
            raise

    def _run_eagerly(self, executor) -> torch.Tensor:
        self.outputs = []
        cuda_stream = self._cuda_stream()
        for j in range(len(self.moe_at) + 1):
            self.outputs.append(self._segment(j))
            if j < len(self.moe_at):
                self._experts(j, executor, cuda_stream)
        return self.outputs[-1]

    def warm_up(self, tokens, positions, rows, mask, slots, executor):
        """Run the step once eagerly, exactly as the graphs will compute it (on a side stream on CUDA): it warms the
        kernels up and is the step's result, (logits, hidden) as `replay` gives them."""
        self._load(tokens, positions, rows, mask, slots)
        if self.cache.device.type != "cuda":
            logits = self._run_eagerly(executor)
        else:
            side = torch.cuda.Stream(self.cache.device)
            side.wait_stream(torch.cuda.current_stream(self.cache.device))
            with torch.cuda.stream(side):
                logits = self._run_eagerly(executor)
            torch.cuda.current_stream(self.cache.device).wait_stream(side)
        self.cache_key = _cache_key(self.cache, executor)  # a verify longer than any before grew the kept states
        return self._result(logits)

    def capture(self, executor, pool) -> None:
        """Capture each segment (after `warm_up`, whose inputs the static tensors still hold)."""
        self.outputs, self.pool = [], pool
        if self.handoff is not None:
            self.handoff.warm_up(self.host_out, self.expert_out, self.host.x, self.host.ids)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool):
                self.handoff.start()
                for j in range(len(self.moe_at) + 1):
                    self.outputs.append(self._segment(j, to_host=False))
                    if j < len(self.moe_at):
                        self._hand_over(j, executor)
            self.pool = graph.pool()
            self.graphs.append(graph)
            self._plan_host_shares(executor)
            log.info("captured one CUDA graph for %d x %d tokens, handing %d MoE layers to the host",
                     *self.tokens.shape, len(self.moe_at))
            return
        for j in range(len(self.moe_at) + 1):
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool):
                self.outputs.append(self._segment(j))
            self.pool = graph.pool()
            self.graphs.append(graph)
        for j, (ranks, rows) in enumerate(zip(self.zero_copy, self.cpu_width)):
            if ranks or rows:
                _, flat, _, ids = self.outputs[j]
                graph = torch.cuda.CUDAGraph()
                with capturing(graph, self.pool):
                    self._zero_copy_share(j, executor, self.model.layers[self.moe_at[j]].moe, flat, ids)
                self.pool = graph.pool()
                self.zero_copy_graphs[j] = graph
        log.info("captured %d CUDA graphs for %d x %d tokens%s (%d layers stream experts from RAM)",
                 len(self.graphs) + len(self.zero_copy_graphs), *self.tokens.shape, " (a tree)" if self.mask is not None
                 else "", len(self.zero_copy_graphs))

    def _load(self, tokens, positions, rows, mask, slots) -> None:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        if self.rows is not None:
            self.rows.copy_(rows)
        if self.mask is not None:
            length = mask.shape[-1]
            self.mask[..., :length].copy_(mask)
            self.mask[..., length:] = False  # past the caller's length: nothing a node may see
            self.slots.copy_(slots)

    def _cuda_stream(self):
        return torch.cuda.current_stream(self.cache.device) if self.host is not None else None

    def replay(self, tokens, positions, rows, mask, slots, executor):
        self._load(tokens, positions, rows, mask, slots)
        if not self.graphs:  # nothing captured: the segments themselves, eagerly
            logits = self._run_eagerly(executor)
        elif self.handoff is not None:
            self.handoff.next_step()
            self.graphs[0].replay()
            self._host_shares()
            logits = self.outputs[-1]
        else:
            cuda_stream = self._cuda_stream()
            for j, graph in enumerate(self.graphs):
                graph.replay()
                if j < len(self.moe_at):
                    self._experts(j, executor, cuda_stream)
            logits = self.outputs[-1]
        return self._result(logits)

    def _result(self, logits):
        # The next replay overwrites the static outputs.
        logits = logits.clone()
        if not self.features:
            return logits
        return logits, {k: self.hidden[k].clone() for k in self.features}


def _cache_key(cache: KVCache, executor) -> tuple:
    return cache.storage_key(), id(executor), getattr(executor, "placement_version", None)


class _OnDevice:
    """The executor as the captured layers see it: experts from device tensors alone."""

    def __init__(self, executor):
        self.executor = executor

    def expert_outputs(self, moe, x, ids, out=None, host=None):
        return self.executor.device_expert_outputs(moe, x, ids)
