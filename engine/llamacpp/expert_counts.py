"""How often llama.cpp's routers picked each expert, per layer: read from its graph through the eval callback.

llama.cpp names the router's choice `ffn_moe_topk-<layer>` in every MoE layer's graph ([top-k, tokens] int32, a
view of the sorted expert ids); the layer's first expert product (`ffn_moe_up`, a MUL_MAT_ID) takes it as its ids.
A context made with `ExpertCounter.callback` as its `cb_eval` asks for those products only (`reads_picks`);
llama.cpp then computes the graph in pieces that end at them and hands each one over once computed, and the
counter adds up its ids. The product runs where the layer's experts are, so for experts in RAM the cut is in a CPU
split, which has no CUDA graph to invalidate. llama.cpp calls the callback for every node of every graph, so it is C
(expert_counts.c, built at first use by kernels.native_build), with this module's Python callback where no compiler
is found. Cutting the graph costs decode speed (a wait for the GPU at each MoE layer), so the counts are a sample:
prompts are counted whole, decode one step in `COUNT_EVERY`, each of its picks counted that many times
(`step_weight`); on the other steps the callback declines every node and llama.cpp runs the graph in one piece.
Layers whose experts are on the GPU are sampled more thinly (`GPU_COUNT_EVERY`): a cut there changes the GPU split's
graph, and ggml-cuda runs it eagerly on that step and the next and captures it again on the one after.
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("expert_counts.c")
FLAGS = ["-O2", "-std=gnu11", "-fPIC", "-shared", "-Wall"]

TOPK_PREFIX = b"ffn_moe_topk-"


class TensorHead(ctypes.Structure):
    """The first fields of ggml.h's `struct ggml_tensor`: what reading a strided tensor needs beyond its name."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10)]  # GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10


GGML_TYPE_I32 = 26  # ggml.h: the type of argsort's expert ids

# Decode steps per counted one: the cost of counting (one step in this many cut at each MoE layer) against how
# fast the heat map fills (several counted steps a second at the decode speeds the app sees).
COUNT_EVERY = 8
# The same for layers whose experts are on the GPU, where a counted step costs the next two their CUDA graphs.
GPU_COUNT_EVERY = 64


def step_weight(prefill: bool, decode_step: int, count_every: int) -> int:
    """What each router pick of a llama_decode step adds to the counts: 1 for a prompt's (counted whole: its graph
    is long enough that the cuts cost nothing visible), `count_every` for the first of each `count_every` decode
    steps (`decode_step` counts them from 0; the step stands for itself and the skipped ones after it), 0 for the
    others (skipped: the callback declines every node)."""
    if count_every < 1:
        raise ValueError(f"count one decode step in {count_every}: must be at least 1")
    if prefill:
        return 1
    return count_every if decode_step % count_every == 0 else 0


def topk_layer(name: bytes) -> int | None:
    """The layer of a graph node named `ffn_moe_topk-<layer>`; None for any other node."""
    if not name.startswith(TOPK_PREFIX):
        return None
    suffix = name[len(TOPK_PREFIX):]
    return int(suffix) if suffix.isdigit() else None


def ids_layer(name: bytes) -> int | None:
    """The layer whose router's choice a node holds: `ffn_moe_topk-<layer>` itself, or the scheduler's copy of it in
    another backend's split (`<backend>#ffn_moe_topk-<layer>#<copy>`); None for any other name."""
    parts = name.split(b"#")
    return topk_layer(parts[1] if len(parts) > 1 else name)


def reads_picks(name: bytes, op: bytes | None) -> bool:
    """Whether a node is where a layer's picks are read: its experts' first product (`ffn_moe_up`, or
    `ffn_moe_gate_up` where gate and up are one tensor), a MUL_MAT_ID whose ids (src[2]) are the router's choice.
    It runs where the experts are: for experts in RAM the graph is cut in a CPU split (the ids there are the
    scheduler's host copy), where a cut at the choice itself fell in a GPU split, and ggml-cuda then ran that
    split's changed graph eagerly and captured it again on the next steps."""
    return (name.startswith(b"ffn_moe_up") or name.startswith(b"ffn_moe_gate_up")) and op == b"MUL_MAT_ID"


def chosen_ids(raw: bytes, ne: tuple[int, ...], nb: tuple[int, ...]) -> np.ndarray:
    """The expert ids of a [top-k, tokens, ...] int32 tensor laid out with byte strides `nb`, read from `raw` (its
    bytes from its first element to its last, as ggml_nbytes counts them): [tokens, top-k]."""
    k, rows = int(ne[0]), int(np.prod(ne[1:]))
    flat = np.frombuffer(raw, dtype=np.int32)
    # The view's rows sit nb[1] bytes apart (argsort kept every expert's id; the view shows the first k).
    if rows > 1 and any(ne[d] > 1 for d in (2, 3)):
        raise ValueError(f"expert ids of shape {tuple(ne)}: expected [top-k, tokens]")
    return np.lib.stride_tricks.as_strided(flat, shape=(rows, k), strides=(int(nb[1]), int(nb[0])), writeable=False)


class _Counter(ctypes.Structure):
    """expert_counts.c's `struct counter`."""

    _fields_ = [("get_name", ctypes.c_void_p), ("nbytes", ctypes.c_void_p), ("tensor_get", ctypes.c_void_p),
                ("layers", ctypes.c_int64), ("experts", ctypes.c_int64), ("counts", ctypes.c_void_p),
                ("tokens", ctypes.c_void_p), ("errors", ctypes.c_int64), ("scratch", ctypes.c_void_p),
                ("scratch_bytes", ctypes.c_size_t), ("weight", ctypes.c_int64), ("reads", ctypes.c_int64),
                ("op_desc", ctypes.c_void_p), ("gpu_weight", ctypes.c_int64), ("on_gpu", ctypes.c_void_p)]


_native, _native_why = None, None
_native_lock = threading.Lock()


def native_library():
    """(expert_counts.c built and loaded, None) or (None, one line saying why not); built once a process."""
    global _native, _native_why
    with _native_lock:
        if _native is None and _native_why is None:
            from moedesk.kernels.native_build import BuildError, build_library, find_compiler

            if find_compiler() is None:
                _native_why = "no C compiler found (install gcc or set CC)"
                return None, _native_why
            try:
                _native = ctypes.CDLL(str(build_library(SOURCE, FLAGS)))
            except (BuildError, OSError) as e:
                _native_why = str(e).splitlines()[0]
                return None, _native_why
            _native.moedesk_counter_free.argtypes = [ctypes.c_void_p]
            _native.moedesk_counter_free.restype = None
        return _native, _native_why


class ExpertCounter:
    """Counts per (layer, expert) since it was made, a sample (`step_weight`): `snapshot()` copies them. A context
    made with `callback` and `user_data` as its cb_eval and cb_eval_user_data counts into it; `begin_step` before
    each llama_decode says what that step counts for. The callback runs on the thread that calls llama_decode (the
    decode thread), snapshots on any. native: the C callback where it builds (else Python's). count_every: one
    decode step in this many is counted (None: COUNT_EVERY); in the layers `on_gpu` marks (their experts are on the
    GPU), one in `gpu_count_every` (None: GPU_COUNT_EVERY)."""

    def __init__(self, api, ggml, layers: int, experts: int, native: bool = True, count_every: int | None = None,
                 on_gpu: Sequence[bool] = (), gpu_count_every: int | None = None):
        self.counts = np.zeros((layers, experts), dtype=np.int64)
        self.tokens = np.zeros(layers, dtype=np.int64)  # tokens routed per layer, weighted as the counts
        self.count_every = COUNT_EVERY if count_every is None else count_every
        self.gpu_count_every = GPU_COUNT_EVERY if gpu_count_every is None else gpu_count_every
        for every in (self.count_every, self.gpu_count_every):
            step_weight(False, 0, every)  # a bad interval fails here, not in the decode thread
        self.on_gpu = np.zeros(layers, dtype=np.uint8)  # the C callback reads it: kept with the counter
        self.on_gpu[:len(on_gpu)] = list(on_gpu)[:layers]
        self._any_on_gpu = bool(self.on_gpu.any())
        self.steps = self.counted_steps = self.decode_steps = 0
        self._python_errors = self._python_reads = 0
        self.weight = self.gpu_weight = 1  # this step's, for layers in RAM and on the GPU (begin_step)
        self._name, self._nbytes, self._get = ggml.ggml_get_name, ggml.ggml_nbytes, ggml.ggml_backend_tensor_get
        self._op = ggml.ggml_op_desc
        lib, _ = native_library() if native else (None, None)
        self._lib, self._struct = lib, None
        if lib is not None:
            address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
            self._struct = _Counter(address(self._name), address(self._nbytes), address(self._get), layers, experts,
                                    self.counts.ctypes.data, self.tokens.ctypes.data, 0, None, 0, 1, 0,
                                    address(self._op), 1, self.on_gpu.ctypes.data)
            self.callback = api.ggml_backend_sched_eval_callback(address(lib.moedesk_count_experts))
            self.user_data = ctypes.addressof(self._struct)
        else:
            self.callback = api.ggml_backend_sched_eval_callback(self._on_node)  # kept alive with the counter
            self.user_data = None

    @property
    def native(self) -> bool:
        return self._lib is not None

    @property
    def errors(self) -> int:
        """Nodes (or ids) that could not be read: 0 unless llama.cpp's graph changed shape."""
        return self._struct.errors if self._struct is not None else self._python_errors

    @property
    def reads(self) -> int:
        """Nodes read since it was made: each one cut a graph there (none on a skipped step)."""
        return self._struct.reads if self._struct is not None else self._python_reads

    def begin_step(self, prefill: bool) -> int:
        """Before a llama_decode of a prompt's tokens (prefill) or of decode tokens: sets the weight of its picks
        (0: skipped) and returns it for the layers whose experts are in RAM (`gpu_weight` has the others'). Decode
        thread only."""
        self.weight = step_weight(prefill, self.decode_steps, self.count_every)
        self.gpu_weight = step_weight(prefill, self.decode_steps, self.gpu_count_every)
        self.decode_steps += not prefill
        self.steps += 1
        self.counted_steps += self.weight > 0 or (self.gpu_weight > 0 and self._any_on_gpu)
        if self._struct is not None:
            self._struct.weight, self._struct.gpu_weight = self.weight, self.gpu_weight
        return self.weight

    def _on_node(self, tensor, ask, user_data) -> bool:
        if ask and self.weight == 0 and self.gpu_weight == 0:
            return False
        try:
            layer = None
            if reads_picks(self._name(tensor) or b"", self._op(tensor)):
                node = TensorHead.from_address(tensor).src[2]  # the router's choice the product reads
                layer = ids_layer(self._name(node) or b"") if node else None
            if layer is None:
                return False
            weight = self.gpu_weight if 0 <= layer < len(self.on_gpu) and self.on_gpu[layer] else self.weight
            if ask:
                return weight > 0
            if weight == 0:
                return True  # not asked for this step; False while computing would stop the graph
            head = TensorHead.from_address(node)
            if head.type != GGML_TYPE_I32 or not 0 <= layer < len(self.counts):
                raise ValueError(f"ffn_moe_topk-{layer}: type {head.type}, not the expected int32 ids")
            size = self._nbytes(node)
            self._python_reads += 1
            raw = ctypes.create_string_buffer(size)
            self._get(node, raw, 0, size)  # from the GPU where the experts run there
            ids = chosen_ids(raw.raw, tuple(head.ne), tuple(head.nb))
            experts = self.counts.shape[1]
            self.counts[layer] += weight * np.bincount(ids.ravel(), minlength=experts)[:experts]
            self.tokens[layer] += weight * ids.shape[0]
        except Exception:  # noqa: BLE001 -- raising through llama.cpp's C frames would crash the process
            self._python_errors += 1
        return True  # in the compute phase False would stop the graph

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """(counts [layers, experts], tokens [layers]) so far, copied (a step running meanwhile may be half in)."""
        return self.counts.copy(), self.tokens.copy()

    def __del__(self):
        if self._struct is not None:
            self._lib.moedesk_counter_free(ctypes.addressof(self._struct))
