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

A model whose layers run on several GPUs (engine.model.layer_devices) is cut at each change of device as well
(`plan_segments`): every segment runs on one device and is captured on that device's stream into that device's pool;
between two replays the host copies the hidden state and rotary tables to the next device, as the eager forward
does. The whole-step graph with host handoff stays one-device: one graph holds one device's stream.

Captured per (batch size, tokens per row, explicit cache rows or not, tree or not, features returned), again
when the cache is reallocated or the executor or its placement changes (the graphs read the resident experts'
weights). One token per row is captured at once (a decode step repeats); more only once a shape recurs and
while fewer than `max_shapes` are held, since speculative shapes vary with the draft length and the rows
running, and a capture costs an eager step plus graph memory.
"""
from __future__ import annotations

import contextlib
import logging
import os
from functools import partial
from typing import NamedTuple, Sequence

import torch

from moedesk.engine.model.cache.kv import KVCache
from moedesk.engine.graph_capture import capturing
from moedesk.engine.hardware import on_device
from moedesk.engine.model.transformer import ForwardBatch, Transformer
from moedesk.engine.offload.expert_executor import HostRouting
from moedesk.kernels.host_handoff import Handoff, handoff_wanted

log = logging.getLogger("moedesk")


def graphs_wanted(device: torch.device) -> bool:
    """CUDA graphs for decode: on CUDA, unless MOEDESK_NO_CUDA_GRAPHS is set."""
    disabled = os.environ.get("MOEDESK_NO_CUDA_GRAPHS", "").strip().lower() not in ("", "0", "false", "no")
    return device.type == "cuda" and not disabled


def shared_early_wanted() -> bool:
    """A handed-over step's shared experts computed while the host runs the routed ones, not after; the same kernels
    on the same inputs (docs/measurements.md, "Session 56"). MOEDESK_SHARED_EARLY=0 computes them after."""
    return os.environ.get("MOEDESK_SHARED_EARLY", "").strip().lower() not in ("0", "false", "no")


class Segment(NamedTuple):
    """A stretch of one step's work on one device, run (or captured) as a whole."""
    device: int  # plan index of its device (0, the embeddings' device, on one GPU)
    start: int  # the first layer it touches (0 with the embeddings)
    end: int  # the layer it stops at: routes that layer for the host, or stops before it (a cut, or the head)
    resumes: bool  # begins with layer `start`'s residual after its host-run experts (else whole layers from start)
    routes: bool  # ends with layer `end`'s routing for the host (else: a cut before layer `end`, or the head at the end)


def plan_segments(device_of_layer: Sequence[int], host_run: Sequence[int]) -> list[Segment]:
    """The segments of a step over layers placed on `device_of_layer` (the embeddings on device 0), cut at each
    layer in `host_run` (its experts run between two segments) and wherever the next layer is on another device."""
    host, segments = set(host_run), []
    start, resumes, here = 0, False, 0
    for layer, device in enumerate(device_of_layer):
        if device != here:  # hand the hidden state to the next device
            segments.append(Segment(here, start, layer, resumes, False))
            start, resumes, here = layer, False, device
        if layer in host:
            segments.append(Segment(device, start, layer, resumes, True))
            start, resumes = layer, True
    segments.append(Segment(here, start, len(device_of_layer), resumes, False))
    return segments


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
        self.pool: dict | None = None  # one memory pool per device for every graph
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
        settle = getattr(executor, "settle", None)
        if settle is not None:
            # The expert cache's swaps decided during the last handed-over step, made now that its graph no longer
            # waits on the host (OffloadExecutor._end_step). They rewrite the slot maps the graphs read in place,
            # queued before the replay below: the graphs stay valid (placement_version moves only with a layer's kind).
            settle()
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
    """The graphs of one shape, one per `Segment`: on one device, segment 0 runs embedding to the routing of the
    first MoE layer whose experts need the host, segment j from the j-th such layer's residual to the next one's
    routing, the last to the logits; over several devices, also cut where the next layer is on another one."""

    def __init__(self, model: Transformer, cache: KVCache, batch: int, length: int, with_rows: bool, tree: bool,
                 features: tuple, executor):
        self.model, self.cache = model, cache
        self.cache_key = _cache_key(cache, executor)
        spread = self.spread = model.spread
        self.devices = spread.devices if spread is not None else (cache.device,)
        # The step's inputs sit with the embeddings (segment 0's device), not with the cache's first part: that is
        # layer 0's device, another GPU where the first holds the embeddings alone.
        device = self.devices[0]
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
        runs_on_device = getattr(executor, "runs_on_device", lambda layer: False)
        self.moe_at = [i for i, block in enumerate(model.layers)
                       if hasattr(block, "moe") and not runs_on_device(block.moe.layer)]
        owner = spread.device_of_layer if spread is not None else (0,) * len(model.layers)
        self.segments = plan_segments(owner, self.moe_at)
        self.routed_by = [k for k, seg in enumerate(self.segments) if seg.routes]  # host-run layer j's segment
        self.moe_index = {layer: j for j, layer in enumerate(self.moe_at)}
        # Per segment, the host-run layer (index into moe_at) whose experts run after it, or None: looked up each replay.
        self.experts_after = [self.moe_index[seg.end] if seg.routes else None for seg in self.segments]
        used = sorted({seg.device for seg in self.segments})
        # Where each device's first segment builds its ForwardBatch (mask, write rows) from its copy of the inputs.
        self.first_on = {d: next(k for k, seg in enumerate(self.segments) if seg.device == d) for d in used}
        self.inputs = {0: (self.positions, self.rows, self.mask, self.slots)}
        for d in used[1:]:  # segment 0, the embeddings, is always device 0's
            self.inputs[d] = tuple(None if t is None else torch.zeros_like(t, device=self.devices[d])
                                   for t in self.inputs[0])
        self.on_device = _OnDevice(executor)  # what the captured MoE layers' experts run through
        dtype, hidden, top_k = model.embed.weight.dtype, model.cfg.hidden_size, model.cfg.num_experts_per_tok
        # A segment after a cut starts from the hidden state and rotary tables the host copied to its device.
        self.x_in = {k: torch.zeros(batch, length, hidden, dtype=dtype, device=self.devices[seg.device])
                     for k, seg in enumerate(self.segments) if k and not seg.resumes}
        self.ropes: dict = {}  # device -> the rotary tables its segments read (device 0's: segment 0's output)
        self.batches: dict[int, ForwardBatch] = {}  # device -> its segments' ForwardBatch, made by the first
        if len(used) > 1:
            rope = model.rotary(self.positions, dtype)
            self.ropes = {d: tuple(torch.zeros_like(t, device=self.devices[d]) for t in rope) for d in used if d}
        with_host = sorted({self.segments[k].device for k in self.routed_by})
        # The executor writes each MoE layer's expert outputs here, on the layer's device, and the next segment
        # reads them.
        self.expert_outs = {d: torch.zeros(tokens * top_k, hidden, dtype=dtype, device=self.devices[d])
                            for d in with_host}
        self.expert_out = self.expert_outs.get(0)  # the one device's, as the handoff uses it
        # Where captured segments leave the routing for the host: per device, whose stream records `ready`.
        self.hosts: dict[int, HostRouting] = {}
        if device.type == "cuda":
            self.hosts = {d: HostRouting(torch.zeros(tokens, hidden, dtype=dtype, pin_memory=True),
                                         torch.zeros(tokens, top_k, dtype=torch.long, pin_memory=True),
                                         torch.cuda.Event()) for d in with_host}
        self.host = self.hosts.get(0)
        # Per host-run MoE layer: how many of the token's last ranks the GPU computes from RAM itself while
        # the host runs the rest (engine.offload.offload_executor.OffloadExecutor.zero_copy_share), in a graph of its own
        # replayed after the host's copy of the routing is queued, so the host need not wait for it.
        share = getattr(executor, "zero_copy_share", None)
        self.zero_copy = [share(model.layers[i].moe.layer, tokens, top_k) if share and self.hosts else 0
                         for i in self.moe_at]
        # Or how many of every expert's first rows the host computes, the GPU the rest into `split_out`, which
        # the next segment adds (OffloadExecutor.width_split); 0: none.
        split = getattr(executor, "width_split", None)
        self.cpu_width = [split(model.layers[i].moe.layer, tokens, top_k) if split and self.hosts else 0
                         for i in self.moe_at]
        self.split_outs = {d: torch.zeros(tokens * top_k, hidden, dtype=torch.float32, device=self.devices[d])
                           for d in with_host} if any(self.cpu_width) else {}
        self.split_out = self.split_outs.get(0)
        # Where no host-run layer needs a host decision, the step is one graph that hands each layer to the
        # host and back through flags (kernels.host_handoff): nothing is launched between layers. One device only:
        # a graph replays on one device's stream, and the hidden state crosses to the next between replays.
        self.handoff: Handoff | None = None
        self.host_plans: list = []  # per host-run layer, the host's side of a handed-over step (`_plan_host_shares`)
        host_only = getattr(executor, "host_only", None)
        if (spread is None and self.host is not None and host_only is not None and handoff_wanted()
                and all(host_only(model.layers[i].moe.layer, tokens, top_k) for i in self.moe_at)):
            self.handoff = Handoff(len(self.moe_at), device)
            self.host_out = torch.zeros(tokens * top_k, hidden, dtype=dtype, pin_memory=True)
        self.zero_copy_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Per handed-over layer: its shared expert's output, computed between the routing's signal and the wait for
        # the host (`_hand_over`), for the next segment to add; filled and read while the step's graph is captured.
        self.shared_early: dict[int, torch.Tensor] = {}
        self.outputs: list = []  # per segment: (x, flat, weights, ids) where it routes, x at a cut, the last: logits
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.pool: dict | None = None  # torch device -> its graphs' memory pool

    def stale(self, cache: KVCache, executor) -> bool:
        return _cache_key(cache, executor) != self.cache_key

    def release(self) -> None:
        """Free the graphs and their outputs now."""
        for graph in [*self.graphs, *self.zero_copy_graphs.values()]:
            graph.reset()
        self.graphs, self.zero_copy_graphs, self.outputs, self.hidden, self.host_plans = [], {}, [], {}, []
        self.shared_early = {}

    def _on(self, d: int):
        """Device d current while its segment or experts run (the eager forward's on_device); nothing on one GPU."""
        return on_device(self.devices[d]) if self.spread is not None else contextlib.nullcontext()

    def _segment(self, k: int, to_host: bool = True):
        """Segment k's work; to_host: end by queueing the copy of its routing to the host (False: the handoff's
        signal copies it)."""
        model, seg = self.model, self.segments[k]
        blocks, d = model.layers, seg.device
        # Over several devices each run of layers reads its own part of the cache, as in the eager forward.
        cache = self.cache if self.spread is None else self.cache[min(seg.start, len(blocks) - 1)]
        if k == self.first_on[d]:
            positions, rows, mask, slots = self.inputs[d]
            # Several tokens a row are a verify forward: recurrent layers keep each token's state for `accept`.
            self.batches[d] = ForwardBatch(positions, rows, self.on_device, kv_len=self.cache.length, mask=mask,
                                           slots=slots, keep_states=self.tokens.shape[1] > 1)
        batch = self.batches[d]
        if k == 0:
            x, self.ropes[0] = model.embed_tokens(self.tokens, self.positions)
        elif seg.resumes:
            x_prev, flat_prev, weights, _ = self.outputs[k - 1]
            y = self.expert_outs[d]
            if self.cpu_width[self.moe_index[seg.start]]:  # the host's rows of each expert plus the GPU's
                y = (y.float() + self.split_outs[d]).to(y.dtype)
            shared = self.shared_early.pop(self.moe_index[seg.start], None)
            x = blocks[seg.start].after_experts(x_prev, flat_prev, blocks[seg.start].moe.combine(y, weights), shared)
        else:
            x = self.x_in[k]
        rope = self.ropes[d]
        first = seg.start + 1 if seg.resumes else seg.start
        # Dense layers, and MoE layers run on the device alone: the model's own layer loop.
        x = model.run_layers(x, rope, cache, batch, first, seg.end, self.features, self.hidden)
        if not seg.routes:
            return model.head(x, self.features, self.hidden) if seg.end == len(blocks) else x
        end = seg.end
        if end in self.features:
            self.hidden[end] = x
        x, flat, weights, ids = blocks[end].before_experts(x, rope, cache, batch)
        host = self.hosts.get(d)
        if host is not None and to_host:
            host.x.copy_(flat, non_blocking=True)
            host.ids.copy_(ids, non_blocking=True)
        return x, flat, weights, ids

    def _between(self, k: int, executor, streams: dict) -> None:
        """The host's work after segment k: its layer's experts, or the hidden state copied to the next device."""
        j = self.experts_after[k]
        if j is not None:
            if self.spread is None:
                self._experts(j, executor, streams.get(0))
            else:
                d = self.segments[k].device
                with on_device(self.devices[d]):
                    self._experts(j, executor, streams.get(d))
        elif k + 1 < len(self.segments):
            self.x_in[k + 1].copy_(self.outputs[k], non_blocking=True)
            there = self.segments[k + 1].device
            if there:
                for mine, home in zip(self.ropes[there], self.ropes[0]):
                    mine.copy_(home, non_blocking=True)

    def _experts(self, j: int, executor, cuda_stream) -> None:
        k = self.routed_by[j]
        d = self.segments[k].device
        _, flat, _, ids = self.outputs[k]
        moe = self.model.layers[self.moe_at[j]].moe
        host = self.hosts.get(d)
        if host is not None:
            # The step's stream, looked up once per step: Event.record() without one asks torch for the current
            # stream, host time paid again at every layer.
            host.ready.record(cuda_stream)
            host.zero_copy, host.cpu_width = self.zero_copy[j], self.cpu_width[j]
            if self.zero_copy[j] or self.cpu_width[j]:
                graph = self.zero_copy_graphs.get(j)
                if graph is not None:
                    graph.replay()
                else:
                    self._zero_copy_share(j, executor, moe, flat, ids)
        executor.expert_outputs(moe, flat, ids, out=self.expert_outs[d], host=host)

    def _zero_copy_share(self, j: int, executor, moe, flat, ids) -> None:
        """Queue the GPU's share of host-run MoE layer j read from RAM: whole experts or every expert's last rows."""
        d = self.segments[self.routed_by[j]].device
        if self.zero_copy[j]:
            executor.zero_copy_experts(moe, flat, ids, self.zero_copy[j], self.expert_outs[d])
        else:
            executor.zero_copy_width(moe, flat, ids, self.cpu_width[j], self.split_outs[d])

    def _hand_over(self, j: int, executor) -> None:
        """Captured after segment j: the routing to the host, the GPU's own share, and once the host is done
        its results into `expert_out`."""
        _, flat, _, ids = self.outputs[j]
        moe = self.model.layers[self.moe_at[j]].moe
        self.handoff.signal(j, (flat, self.host.x), (ids, self.host.ids))  # one device: segment j routes layer j
        if shared_early_wanted():  # the shared expert needs no routing: the GPU computes it while the host works
            shared = moe.shared_out(flat)
            if shared is not None:
                self.shared_early[j] = shared
        resident = executor.device_share(moe, flat, ids) if executor.has_resident(moe.layer) else None
        if self.zero_copy[j] or self.cpu_width[j]:
            self._zero_copy_share(j, executor, moe, flat, ids)
        rows = self.host_out.shape[0] - self.zero_copy[j]
        self.handoff.wait(j, self.host_out[:rows], self.expert_out[:rows])
        if resident is not None:
            y, mask = resident
            self.expert_out.copy_(torch.where(mask[:, None], y, self.expert_out))

    def _warm_device_shares(self, executor) -> None:
        """The resident experts' grouped launch of each handed-over layer (`device_share`), run once before the
        capture on `warm_up`'s routing: the eager step computes resident experts another way, so without this a
        grouped kernel's first launch (Triton compiling and loading it) would fall inside the capture, which fails
        and turns graphs off."""
        for j, i in enumerate(self.moe_at):
            moe = self.model.layers[i].moe
            if executor.has_resident(moe.layer):
                _, flat, _, ids = self.outputs[j]
                executor.device_share(moe, flat, ids)

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
        streams = self._cuda_streams()
        for k, seg in enumerate(self.segments):
            with self._on(seg.device):
                self.outputs.append(self._segment(k))
            self._between(k, executor, streams)
        return self.outputs[-1]

    def warm_up(self, tokens, positions, rows, mask, slots, executor):
        """Run the step once eagerly, exactly as the graphs will compute it (on a side stream per device on CUDA): it
        warms the kernels up and is the step's result, (logits, hidden) as `replay` gives them."""
        self._load(tokens, positions, rows, mask, slots)
        if self.cache.device.type != "cuda":
            logits = self._run_eagerly(executor)
        else:
            devices = list(dict.fromkeys(self.devices[seg.device] for seg in self.segments))
            sides = [torch.cuda.Stream(device) for device in devices]
            with contextlib.ExitStack() as streams:
                for device, side in zip(devices, sides):
                    side.wait_stream(torch.cuda.current_stream(device))
                    streams.enter_context(torch.cuda.stream(side))
                logits = self._run_eagerly(executor)
            for device, side in zip(devices, sides):
                torch.cuda.current_stream(device).wait_stream(side)
        self.cache_key = _cache_key(self.cache, executor)  # a verify longer than any before grew the kept states
        return self._result(logits)

    def capture(self, executor, pool: dict | None) -> None:
        """Capture each segment (after `warm_up`, whose inputs the static tensors still hold) on its device, into
        that device's pool (`pool`: torch device -> pool, None: fresh ones)."""
        if self.handoff is not None:
            self._warm_device_shares(executor)
        self.outputs, self.pool, self.shared_early = [], dict(pool or {}), {}
        if self.handoff is not None:
            self.handoff.warm_up(self.host_out, self.expert_out, self.host.x, self.host.ids)
            graph = torch.cuda.CUDAGraph()
            home = self.devices[0]
            with capturing(graph, self.pool.get(home)):
                self.handoff.start()
                for j in range(len(self.moe_at) + 1):
                    self.outputs.append(self._segment(j, to_host=False))
                    if j < len(self.moe_at):
                        self._hand_over(j, executor)
            self.pool[home] = graph.pool()
            self.graphs.append(graph)
            self._plan_host_shares(executor)
            log.info("captured one CUDA graph for %d x %d tokens, handing %d MoE layers to the host",
                     *self.tokens.shape, len(self.moe_at))
            return
        # torch's default capture stream lives on the device that first captured: a device of several gets its own.
        streams = {} if self.spread is None else {d: torch.cuda.Stream(d) for d in set(self.devices)}
        for k, seg in enumerate(self.segments):
            device = self.devices[seg.device]
            graph = torch.cuda.CUDAGraph()
            with self._on(seg.device), capturing(graph, self.pool.get(device), streams.get(device)):
                self.outputs.append(self._segment(k))
            self.pool[device] = graph.pool()
            self.graphs.append(graph)
        for j, (ranks, rows) in enumerate(zip(self.zero_copy, self.cpu_width)):
            if ranks or rows:
                k = self.routed_by[j]
                _, flat, _, ids = self.outputs[k]
                device = self.devices[self.segments[k].device]
                graph = torch.cuda.CUDAGraph()
                with self._on(self.segments[k].device), capturing(graph, self.pool.get(device), streams.get(device)):
                    self._zero_copy_share(j, executor, self.model.layers[self.moe_at[j]].moe, flat, ids)
                self.pool[device] = graph.pool()
                self.zero_copy_graphs[j] = graph
        log.info("captured %d CUDA graphs for %d x %d tokens%s (%d layers stream experts from RAM) on %d devices",
                 len(self.graphs) + len(self.zero_copy_graphs), *self.tokens.shape, " (a tree)" if self.mask is not None
                 else "", len(self.zero_copy_graphs), len(self.pool))

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
        for d, inputs in self.inputs.items():  # each other device's copy, read by its ForwardBatch
            if d:
                for mine, home in zip(inputs, self.inputs[0]):
                    if mine is not None:
                        mine.copy_(home, non_blocking=True)

    def _cuda_streams(self) -> dict:
        """Each device's current stream where a segment there hands routing to the host, looked up once a step."""
        return {d: torch.cuda.current_stream(self.devices[d]) for d in self.hosts}

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
            streams = self._cuda_streams()
            for k, graph in enumerate(self.graphs):
                graph.replay()  # on its own device's current stream
                self._between(k, executor, streams)
            logits = self.outputs[-1]
        return self._result(logits)

    def _result(self, logits):
        # The next replay overwrites the static outputs; over several devices they come back to the first.
        home = self.devices[0]
        logits = _copy_to(logits, home)
        if not self.features:
            return logits
        return logits, {k: _copy_to(self.hidden[k], home) for k in self.features}


def _copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, copy=True)


def _cache_key(cache: KVCache, executor) -> tuple:
    return cache.storage_key(), id(executor), getattr(executor, "placement_version", None)


class _OnDevice:
    """The executor as the captured layers see it: experts from device tensors alone."""

    def __init__(self, executor):
        self.executor = executor

    def expert_outputs(self, moe, x, ids, out=None, host=None):
        return self.executor.device_expert_outputs(moe, x, ids)
