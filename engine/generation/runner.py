"""One model's forwards over one cache: what plain decoding, beam search and speculation all run through.

A `ModelRunner` owns a cache (the kind the model makes, `Transformer.new_cache`), the CUDA graphs over it
(engine.generation.cuda_graphs) with the eager forward as their fallback, the out-of-memory retry, and the
stop set (the token ids that end a sequence). The decoder, a beam search and a speculator each hold one:
their rows are their own, their forwards and cache operations the same code.

`prefill` runs eagerly (prompt shapes vary); `step` replays graphs where they are on and the shape is
captured, and runs the same forward eagerly otherwise.

A retry after an out-of-memory error must compute what one successful run would. A KV cache is rewritten
unchanged by it; a recurrent state (Gated DeltaNet) is not: the layers before the failure have already taken
the tokens, and would take them twice. So before a forward over a stateful cache the runner copies the current
states of the rows it touches (`save`) and puts them back before a retry. That copy is one read and write of
those rows' states per step, in two copies (every layer's state is a view of one tensor); deferring the layers'
writes to the end of the forward instead would copy nothing more, but CUDA graphs write in place and can fail
between their segments (a host-run layer's experts), and a copy that covers every path is the smaller risk. No retry, no copy: it is
taken only while `can_free()` says an out-of-memory error would be retried (experts left on the GPU to move).

`fork` (beam search) and `accept` (speculation) are the cache kind's row operations.

On a CPU load whose matrices the native packed kernels compute (engine.model.packed_linear), the kernels' pool and
torch's OpenMP team (norms, attention, sampling between the layers' calls) share the cores, and each spins after its
work: both waited for each other. So a forward of few tokens (a decode step, a short prompt) over a short context
runs torch on one thread while the pool spins for the next call; a longer one, or one deep in a long context, whose
attention needs every core, gives torch every thread and lets the pool's workers sleep between calls (`cores_for`).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable

import torch

from moedesk.engine.errors import MoedeskError
from moedesk.engine.model.mla import LatentAttention
from moedesk.engine.model.packed_linear import PackedLinear
from moedesk.kernels import cpu_experts, cpu_quant

# Tokens a forward up to which torch's ops take one thread beside the spinning pool; more take every thread with
# the pool asleep between calls (the crossing measured, docs/measurements.md "Session 70")
SHORT_FORWARD = 256
# Keys a row's attention reads (its context), on average over the forward's rows, from which a short forward's
# attention in torch wants every thread too: a few tokens deep in a long chat (docs/measurements.md, "Session 71")
LONG_CONTEXT = 2048


def one_thread_forward(tokens: int, context: int, pool_attention: bool) -> bool:
    """Whether a forward of `tokens` tokens whose rows read `context` keys each on average runs torch on one thread
    beside the spinning pool (else every thread, the pool asleep between calls). pool_attention: its attention runs
    on the pool too (kernels/cpu_attention.py), at any depth."""
    return tokens <= SHORT_FORWARD and (pool_attention or context < LONG_CONTEXT)


class ModelRunner:
    """Forwards of `model` over a cache of its own, grown on demand (`reserve`)."""

    def __init__(self, model, device, dtype, context_length: int, stop_ids=frozenset(), on_oom=None,
                 graphs: bool | Callable = False, advice: str = "use a shorter context or a smaller batch",
                 can_free: Callable[[], bool] | None = None):
        """stop_ids: tokens that end a sequence. on_oom() frees GPU memory after an out-of-memory error (moves
        experts to RAM) and returns True to retry, False to give up. graphs: replay `step` from CUDA graphs
        (True), not (False), or a factory (model, cache) -> GraphedDecode (tests run capture=False segments on
        the CPU). advice: how a user avoids the out-of-memory error nothing is left to free for. can_free():
        whether on_oom() may free anything now (None: assume it may), asked before each forward over a recurrent
        state, whose rows are copied only where a retry may follow."""
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.context_length = context_length
        self.stop_ids = frozenset(stop_ids)
        self.on_oom = on_oom
        self.can_free = can_free
        self.use_graphs = graphs
        self.advice = advice
        self.cache = None  # made by the first `reserve`
        self.graphs = None  # made with the cache, whose tensors its graphs read
        self.native_cpu = native_matrices(model, self.device)  # see the module docstring
        # a decode step's attention on the pool in every layer that has one (Transformer's Attention.native_decode)
        self.pool_decode = self.native_cpu and dtype == torch.float32 and pool_decode(model)

    def reserve(self, rows: int, length: int) -> None:
        """Room for `rows` sequences of `length` positions, keeping what the cache holds (it only grows; a
        reallocation moves its tensors, which the graphs notice and capture again)."""
        if self.cache is None:
            self.cache = self.retrying(lambda: self.model.new_cache(rows, length, self.dtype, self.device))
            if self.use_graphs and getattr(self.model, "supports_graphs", True):
                from moedesk.engine.generation.cuda_graphs import GraphedDecode

                make = self.use_graphs if callable(self.use_graphs) else GraphedDecode
                self.graphs = make(self.model, self.cache)
        else:
            self.retrying(lambda: self.cache.ensure(rows, length))

    def shrink(self, rows: int, length: int) -> None:
        """Give the cache's memory back down to `rows` x `length` (nothing it holds is kept) and drop the graphs
        over the old tensors: no sequence may be running."""
        self.release_graphs()
        if self.cache is not None:
            self.cache.shrink(rows, length)

    def release_graphs(self) -> None:
        """Free every captured graph and the memory it holds now; later steps capture afresh."""
        if self.graphs is not None and getattr(self.graphs, "release", None) is not None:
            self.graphs.release()

    def prefill(self, tokens, positions, executor, rows=None, logits_at=None, features: tuple = ()):
        """The model's forward, eagerly (`Transformer.forward`'s arguments), retried after an out-of-memory
        error: a retry writes the same keys and values at the same positions, and starts from the recurrent
        states the first attempt started from, so it computes what the first attempt would have."""
        def forward():
            with self.cores_for(tokens, positions):
                return self.model(tokens, positions, self.cache, executor, rows=rows, logits_at=logits_at,
                                  features=features)

        return self.retrying(forward, (rows, tokens))

    def step(self, tokens, positions, executor, rows=None, mask=None, slots=None, features: tuple = ()):
        """Every position's logits (and features) of tokens [B, T]: replayed from CUDA graphs where they are on
        and the shape is captured, else the same forward eagerly; retried after an out-of-memory error."""
        return self.retrying(lambda: self._step(tokens, positions, executor, rows, mask, slots, features),
                             (rows, tokens))

    def _step(self, tokens, positions, executor, rows, mask, slots, features):
        out = None
        if self.graphs is not None:
            out = self.graphs.forward(tokens, positions, executor, rows, mask=mask, slots=slots, features=features)
        if out is None:
            with self.cores_for(tokens, positions):
                out = self.model(tokens, positions, self.cache, executor, rows=rows, mask=mask, slots=slots,
                                 features=features, drafts=True)
        return out

    def cores_for(self, tokens, positions=None):
        """How a forward of `tokens` [B, T] at `positions` [B, T] shares the cores with the native kernels' pool
        (module docstring)."""
        if not self.native_cpu:
            return nullcontext()
        context = 0 if positions is None else int(positions[:, -1].sum()) // positions.shape[0] + 1
        one = one_thread_forward(tokens.numel(), context, self.pool_decode and tokens.shape[1] == 1)
        return one_torch_thread() if one else cpu_experts.not_spinning()

    def fork(self, block: list[int], source: list[int], length: int) -> None:
        """Row block[j] continues what row block[source[j]] holds, up to `length` positions (beam search)."""
        self.cache.reorder(block, source, length)

    def accept(self, rows: list[int], starts: list[int], paths: list[list[int]]) -> None:
        """After a verify forward that wrote row rows[i]'s draft nodes at slots starts[i] + node: keep the nodes
        of paths[i] (root excluded, root to leaf) as positions starts[i] + 1, + 2, ..., and nothing of the rest."""
        self.cache.accept(rows, starts, paths)

    def graph_captures(self) -> int:
        """Shapes captured so far, and forwards left eager until their shape recurs: each a one-off cost a bench
        leaves out (0 without graphs)."""
        return self.graphs.captures + self.graphs.warmups if self.graphs is not None else 0

    def retrying(self, step, touched: tuple | None = None):
        """step() retried after out-of-memory errors; touched: (rows, tokens) of a forward over the cache, whose
        recurrent states a failed attempt may have fed part way (put back before the retry, or the error)."""
        saved = None
        if (touched is None or self.on_oom is None or not getattr(self.cache, "stateful", False)
                or (self.can_free is not None and not self.can_free())):
            return retrying_oom(step, self.on_oom, self.advice)

        def attempt():
            nonlocal saved
            if saved is None:  # inside the retry: a copy that finds no room is retried like the forward
                rows, tokens = touched
                saved = self.cache.save(rows, tokens.shape[0])
            return step()

        def undo():
            if saved is not None:
                self.cache.restore(saved)

        return retrying_oom(attempt, self.on_oom, self.advice, undo)


def native_matrices(model, device: torch.device) -> bool:
    """Whether `model` on `device` has its matrices computed by the native CPU kernels: a CPU load holding packed
    weights, with the kernel that computes them here."""
    return (device.type == "cpu" and isinstance(model, torch.nn.Module)
            and any(isinstance(m, PackedLinear) for m in model.modules()) and cpu_quant.available())


def pool_decode(model) -> bool:
    """Whether every attention layer of `model` computes a decode step on the native pool: those of the kind
    engine.model.transformer.Attention says so of, and no other kind (MLA, which attends in torch)."""
    attentions = [m for m in model.modules() if hasattr(m, "native_decode") or isinstance(m, LatentAttention)]
    return bool(attentions) and all(getattr(m, "native_decode", False) for m in attentions)


@contextmanager
def one_torch_thread():
    """torch's intra-op threads set to one for the block, then back to what they were."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def retrying_oom(step, on_oom, advice: str, undo=None):
    """Run step(); after a GPU out-of-memory error undo() what the failed attempt changed, let on_oom() free
    memory (move experts to RAM) and run it again, until it has nothing left to free: then one line that ends
    with `advice`."""
    while True:
        try:
            return step()
        except torch.OutOfMemoryError as error:
            if undo is not None:
                undo()
            if on_oom is None or not on_oom():
                raise MoedeskError(f"GPU out of memory with nothing left to move to RAM: {advice}") from error
