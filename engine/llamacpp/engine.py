"""`LlamaCppEngine`: a GGUF model run by llama.cpp, behind the face front ends know (engine.interface.EngineFace).

Requests go through the same scheduler as the native engine's (continuous batching, streaming, cancel, grammars,
stop strings, per-request sampling); only the decoder differs (engine.llamacpp.decoder). Beam search and EAGLE
speculation are native-engine features: asking for them here is one line.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from moedesk import libstdcxx
from moedesk.engine.cpu_share import CpuShare
from moedesk.engine.errors import CheckpointError, MoedeskError
from moedesk.engine.memory_fit import shortfall
from moedesk.engine.generation.scheduler import Scheduler, default_prefill_chunk
from moedesk.engine.load.demo import cache_root
from moedesk.engine.llamacpp.amx_probe import extra_buffers_safe
from moedesk.engine.llamacpp.buffers import failed_gpu_bytes
from moedesk.engine.llamacpp.compute import offload_copy_bytes
from moedesk.engine.llamacpp.decoder import LlamaContext, LlamaCppDecoder, NoContext
from moedesk.engine.llamacpp.expert_counts import ExpertCounter
from moedesk.engine.llamacpp.library import cuda_hint, library, torch_first_hint
from moedesk.engine.llamacpp.overrides import Overrides, experts_pattern, overridden_tensors
from moedesk.engine.llamacpp.fit import (FIRST_SLOTS, Fit, Machine, cache_cells, gguf_shape, gpu_split, plan,
                                        read_header, this_machine, value)
from moedesk.engine.llamacpp.placement import GIB, Placement, backed_off, context_backed_off
from moedesk.engine.llamacpp.vocab import LlamaVocab
from moedesk.engine.model.config import ModelConfig
from moedesk.engine.interface import EngineFace

log = logging.getLogger("moedesk")
NATIVE_ONLY = "{what} is a native-engine feature; this model runs on llama.cpp (--engine native where it loads)"
_hinted = False  # the CUDA rebuild line is said once a process


class LlamaCppEngine(EngineFace):
    kind = "llama.cpp"

    def __init__(self, api, model, context: LlamaContext, vocab: LlamaVocab, config: ModelConfig,
                 placement: Placement, name: str, why: str, path: Path):
        # The scheduler and everything built on it (submit, generate, complete, stream: EngineFace) are the
        # native engine's own; only the decoder it runs is llama.cpp's.
        self.api, self._model, self.llama = api, model, context
        self.tokenizer, self.config, self.placement = vocab, config, placement
        self.name, self.why, self.path = name, why, path
        self.vocab_size = config.vocab_size
        self.context_length = context.context_length
        self.device = torch.device("cuda" if placement.gpu_layers else "cpu")
        self.dtype = None
        self.orchestra = None
        self.warnings: list[str] = []
        self.cache = _KVFace(self)
        self.scheduler = Scheduler(self._decoder, max_rows=context.slots, prefill_chunk=context.batch_tokens,
                                   cpu_share=CpuShare(context.set_threads, lambda: context.threads))
        self._grammar_tokenizer = None
        self.generation_defaults: dict = {}  # the model's own sampling defaults, where the user set none
        self.overridden: dict[str, str] = {}  # tensor -> buffer type, as llama.cpp's load log said
        self.fit = None  # engine.llamacpp.fit.Fit: what the load decided it holds in RAM and on the GPU
        self._most_sequences: int | None = None  # the most llama.cpp could make a context for, once it could not

    @classmethod
    def load(cls, model: str, *, device: str = "auto", dtype: str | None = None,
             context_length: int | None = None, gpu_budget: float | None = None, offload: bool | None = None,
             reprofile: bool = False, progress=None, expert_dtype: str = "auto", cpu_moe: int | None = None,
             name: str | None = None, why: str = "llama.cpp engine, as asked", count_experts: bool = True,
             **_) -> "LlamaCppEngine":
        """Load the GGUF file `model` (path) with llama.cpp. cpu_moe: pin the first N layers' experts to RAM
        (llama.cpp's --n-cpu-moe); None: chosen for the GPU budget (engine.llamacpp.placement). count_experts:
        count the routers' picks per layer and expert (the heat map's counts; engine.llamacpp.expert_counts: a
        sample of the decode steps, for speed); `count_experts(False)` turns it off later."""
        global _hinted
        lib = library()
        api = lib.api
        path = Path(model)
        if not path.is_file():
            raise CheckpointError(path, "no such GGUF file")
        warnings = []
        if expert_dtype not in (None, "auto"):
            warnings.append(f"--expert-dtype {expert_dtype} is a native-engine option; llama.cpp keeps the "
                            f"file's formats")
        if gpu_budget is not None and gpu_budget < 0:
            raise MoedeskError(f"--gpu-budget {gpu_budget}: must be >= 0 GiB")
        hint = cuda_hint(_nvidia_gpus(), lib.gpu_offload())
        if hint and not _hinted:
            warnings.append(hint)
            _hinted = True
        machine = this_machine(device)
        use_gpu = machine.gpu
        late = torch_first_hint(use_gpu, libstdcxx.before_torch, sys.platform.startswith("linux"))
        if late:
            print(f"moedesk: {late}", file=sys.stderr, flush=True)  # now: a crash in the load would take a warning
            warnings.append(late)
        if device.startswith("cuda") and not use_gpu:
            warnings.append(f"--device {device}: llama.cpp has no GPU device here; it runs on the CPU")
        extra_buffers = extra_buffers_safe(cache_root(), lib.version)
        if not extra_buffers:
            warnings.append("llama.cpp's AMX kernels crashed in a probe on this machine: its CPU work runs without "
                            "them")
        reader = read_header(path)
        path = Path(reader.paths[0])  # of a split GGUF, the first part: llama.cpp loads the others from its name
        shape = gguf_shape(reader)
        sizes = shape.sizes
        if progress:
            progress("load", 0.0)
        # The Models screen asks the same plan of the same header and machine: it says what this load decides.
        fit = plan(shape, machine, context_length, gpu_budget, cpu_moe)
        warnings += fit.notes
        placement, offload_kv = fit.placement, use_gpu
        while True:
            # Before llama.cpp reads a byte of the weights: the memory the process may use must hold what stays
            # in RAM under this placement (a cgroup's limit otherwise ends the process half way through).
            if not fit.fits:
                raise MoedeskError(fit.refusal(str(path)))
            mark = lib.log_mark()
            # several GPUs: each takes the layers its room holds, not llama.cpp's count of layers by free memory
            split = gpu_split(shape, placement, machine, fit.context)
            handle, stopped = _load_file(lib, path, placement, progress, split, machine.gpu_index, extra_buffers)
            if stopped:
                if handle:
                    api.llama_model_free(handle)
                raise stopped[0]
            if not handle:
                fewer = backed_off(sizes, placement) if _gpu_allocation_failed(lib.log_since(mark)) else None
                if fewer is None:
                    raise CheckpointError(path, "llama.cpp could not load this file"
                                                + _detail(lib.log_since(mark), "error"))
                # As the native engine does on the GPU's out-of-memory: fewer experts there, and a line that says so.
                fit, placement = _fewer_on_gpu(shape, machine, context_length, gpu_budget, fewer)
                warnings.append(f"llama.cpp could not allocate its GPU buffers; {placement.why}")
                continue
            made = lib.log_mark()
            try:
                vocab = LlamaVocab(api, handle, str(path))
                config = _config(api, handle, vocab, sizes)
                context = min(fit.context, config.max_position_embeddings or fit.context)
                threads = max(1, torch.get_num_threads())
                batch_tokens = max(default_prefill_chunk(torch.device("cuda" if use_gpu else "cpu")), 512)
                counter = _counter(api, lib, config, placement) if count_experts and config.is_moe else None
                llama = _make_context(api, handle, context, FIRST_SLOTS, batch_tokens, threads, offload_kv, counter)
            except BaseException:
                api.llama_model_free(handle)
                raise
            if llama is not None:
                break
            # The weights fit the GPU but the context (KV cache, compute buffer) did not fit beside them: load
            # again with room made, smallest step first.
            api.llama_model_free(handle)
            log = lib.log_since(made)
            short, cells = failed_gpu_bytes(log), cache_cells(context)
            # llama.cpp keeps a recurrent model's state where it keeps the KV cache (one offload setting for both)
            kv = FIRST_SLOTS * (cells * shape.kv_per_position + shape.state_per_sequence)
            fewer = None if short is None else context_backed_off(
                sizes, placement, short + (offload_copy_bytes(shape.graph, cells) if shape.graph and not
                                           placement.cpu_moe else 0))  # the first pinned layer grows the buffer
            if fewer is not None:
                fit, placement = _fewer_on_gpu(shape, machine, context_length, gpu_budget, fewer)
            elif short is not None and offload_kv and kv >= short:
                # Last: llama.cpp keeps the cache (and attention over it, and any recurrent state) in RAM, which
                # frees what was asked.
                offload_kv, ram = False, fit.ram_bytes + kv
                fit = replace(fit, ram_bytes=ram, gpu_bytes=fit.gpu_bytes - kv,
                              problem=shortfall(ram, fit.available, {}))
                placement = replace(placement, why=f"{placement.why}; the KV cache in RAM: the GPU could not hold it")
            else:
                where = " on the GPU with every expert in RAM" if short is not None else ""
                raise NoContext(f"llama.cpp could not make a context of {context} positions{where}"
                                f"{_detail(log, 'failed to initialize the context', 'error')}: use a shorter "
                                f"--context")
            warnings.append(f"llama.cpp could not make its context on the GPU; {placement.why}")
        engine = cls(api, handle, llama, vocab, config, placement, name or model, why, path)
        engine.fit = replace(fit, placement=placement)
        engine.warnings = warnings
        engine.overridden = overridden_tensors(lib.log_since(mark))
        engine.generation_defaults = _generation_defaults(reader, name or model)
        if progress:
            progress("load", 1.0)
        return engine

    # --- what the native engine has and this one says it has not -------------------------------

    def _kind(self, decoding, limit):
        if decoding is None:
            return None
        what = "beam search" if type(decoding).__name__ == "BeamOptions" else "speculative decoding"
        raise MoedeskError(NATIVE_ONLY.format(what=what))

    def beam_search(self, prompt_ids, *args, **kwargs):
        raise MoedeskError(NATIVE_ONLY.format(what="beam search"))

    def speculate(self, *args, **kwargs):
        raise MoedeskError(NATIVE_ONLY.format(what="speculative decoding"))

    def load_draft(self, path):
        raise MoedeskError(NATIVE_ONLY.format(what="an EAGLE draft head"))

    # --- the engine face ---------------------------------------------------------------------

    def _decoder(self) -> LlamaCppDecoder:
        on_gpu, _ = self.expert_map()
        k = self.config.num_experts_per_tok
        gpu_layers = sum(all(row) for row in on_gpu)
        return LlamaCppDecoder(self.llama, self.tokenizer, self.context_length, self.config.eos_token_ids,
                               experts_per_token=(k * gpu_layers, k * (len(on_gpu) - gpu_layers)))

    @property
    def description(self) -> str:
        cfg = self.config
        shape = f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if cfg.is_moe else "dense"
        return f"{self.name} ({cfg.arch}, {cfg.num_layers} layers, {shape}) on llama.cpp, {self.placement.why}"

    def expert_map(self) -> tuple[list[list[bool]], list[list[int]]]:
        """Per MoE layer and expert: on the GPU (a whole layer's experts are, or none), and how often the router
        picked it since load, estimated from a sample (engine.llamacpp.expert_counts; zeros while counting is off)."""
        cfg = self.config
        layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        counter = self.llama.counter
        counts = counter.snapshot()[0] if counter is not None else None
        return ([[self.placement.expert_layer_on_gpu(i)] * cfg.num_experts for i in layers],
                [counts[i].tolist() if counts is not None else [0] * cfg.num_experts for i in layers])

    def expert_stats(self) -> dict:
        """Where the experts are and, while counting, where the picks since load ran: a layer's experts compute
        where its tensors are. The picks are estimates: prompts counted whole, one decode step in
        `count_every` counted that many times."""
        if not self.config.is_moe:
            return {}
        on_gpu, picks = self.expert_map()
        total = sum(len(row) for row in on_gpu)
        stats = {"engine": self.kind, "experts_on_gpu": sum(map(sum, on_gpu)), "experts_total": total,
                 "expert_layers_in_ram": sum(not any(row) for row in on_gpu),
                 "expert_gib_in_ram": round(self.placement.expert_bytes_in_ram / GIB, 3),
                 "expert_counts": self.llama.counter is not None}
        if self.llama.counter is not None:
            stats["count_every"] = self.llama.counter.count_every
            if any(map(any, on_gpu)):
                stats["gpu_count_every"] = self.llama.counter.gpu_count_every
            gpu = sum(sum(row) for row, where in zip(picks, on_gpu) if any(where))
            cpu = sum(sum(row) for row, where in zip(picks, on_gpu) if not any(where))
            stats.update(experts_gpu=gpu, experts_cpu=cpu, gpu_hit_rate=gpu / (gpu + cpu) if gpu + cpu else None)
        return stats

    def count_experts(self, on: bool, timeout: float = 30.0) -> bool:
        """Count the routers' picks (on) or not, from the next step: the context is made again (what it held is
        gone) while nothing runs; False if requests kept it busy for `timeout` seconds. Counts start at zero. NoContext
        (one line) where llama.cpp cannot make the new context: the old one, and its counting, go on."""
        if not self.config.is_moe or on == (self.llama.counter is not None):
            return True
        lib = library()

        def switch():
            old = self.llama.counter  # alive until the context that calls it is gone
            self.llama.counter = _counter(self.api, lib, self.config, self.placement) if on else None
            try:
                self.llama.resize(self.llama.slots)
            except BaseException:
                self.llama.counter = old  # the old context, which llama.cpp kept, still calls it
                raise
            del old

        return self.scheduler.when_idle(switch, timeout)

    def grammar(self, response_format):
        """As the native engine's (the same llguidance masks), over llama.cpp's own vocabulary."""
        from moedesk.engine.generation.sampling import compile_response_format

        eos = set(self.config.eos_token_ids)
        if self._grammar_tokenizer is None:
            from llguidance.llamacpp import lltokenizer_from_vocab

            self._grammar_tokenizer = lltokenizer_from_vocab(self.tokenizer.vocab, n_vocab=self.vocab_size,
                                                             eos_token=sorted(eos))
        return compile_response_format(response_format, self._grammar_tokenizer, self.vocab_size, eos)

    def make_room(self, sequences: int, timeout: float = 30.0) -> bool:
        """A context for `sequences` decoding together (serve's and batch's batch size), made while nothing runs;
        False if requests kept it busy for `timeout` seconds. Where llama.cpp cannot make one that large (out of
        memory), half as many, and so on down to the sequences it has, with a warning: the requests beyond wait."""
        sequences = max(1, min(sequences, self.llama.batch_tokens, self._most_sequences or sequences))
        if sequences <= self.llama.slots:
            return True

        def grow():
            want = sequences
            while want > self.llama.slots:
                try:
                    self.llama.resize(want)
                    break
                except NoContext:
                    want //= 2
            if self.llama.slots < sequences:
                self._most_sequences = self.llama.slots  # not tried again, nor said again
                line = (f"llama.cpp could not make a context for {sequences} sequences of {self.context_length} "
                        f"positions; {self.llama.slots} decode together, the others wait")
                self.warnings.append(line)
                log.warning("%s", line)
            self.scheduler.max_rows = self.llama.slots

        return self.scheduler.when_idle(grow, timeout)

    def generate(self, requests, batch_size: int = 8, decoding=None, refill: int = 1):
        self.make_room(batch_size)
        return super().generate(requests, batch_size, decoding, refill)

    def complete(self, requests, decoding=None):
        self.make_room(len(requests))
        return super().complete(requests, decoding)

    def release_cache(self, timeout: float = 30.0) -> bool:
        return True  # the context's cells are allocated once, for its sequences

    def close(self) -> None:
        self.scheduler.close()
        self.llama.close()
        if self._model:
            self.api.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- at interpreter exit the library may be gone first
            pass


class _KVFace:
    """What front ends read of an engine's KV cache: bytes per position (to size a batch) and `ensure`."""

    def __init__(self, engine: LlamaCppEngine):
        self.engine = engine

    @property
    def rows(self) -> int:
        return self.engine.llama.slots

    def bytes_per_position(self) -> int:
        cfg = self.engine.config
        return 2 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # keys and values in f16, llama.cpp's default

    def ensure(self, rows: int, length: int) -> None:
        if not self.engine.make_room(rows):
            raise MoedeskError("the llama.cpp engine is busy: its context cannot grow now")


def _load_file(lib, path: Path, placement: Placement, progress, split: tuple[int, ...] | None = None,
               gpu: int | None = None, extra_buffers: bool = True) -> tuple[int | None, list[BaseException]]:
    """llama.cpp's model handle (None when it could not load) under `placement`, and what `progress` raised. split:
    the layers each GPU takes (engine.llamacpp.fit.gpu_split; None: llama.cpp's own split). gpu: the one GPU
    `--device cuda:N` names (Machine.gpu_index; None: every GPU llama.cpp sees). extra_buffers False: no AMX or
    repacked weight buffers (engine.llamacpp.amx_probe)."""
    api = lib.api
    params = api.llama_model_default_params()
    if hasattr(params, "use_extra_bufts"):
        params.use_extra_bufts = extra_buffers
    if placement.page_locked:  # read, not mapped: the experts in RAM land in the GPU's page-locked memory
        if hasattr(params, "load_mode"):
            params.load_mode = api.LLAMA_LOAD_MODE_NONE
        else:  # llama-cpp-python before llama.cpp's load modes
            params.use_mmap = False
    params.n_gpu_layers = placement.gpu_layers
    if gpu is not None and placement.gpu_layers:
        # llama.cpp's single-GPU mode keeps main_gpu (an index into the GPUs it sees, CUDA's order) and drops the rest
        params.split_mode = api.LLAMA_SPLIT_MODE_NONE
        params.main_gpu = gpu
    shares = None
    if split and len(split) <= api.llama_max_devices():
        # layer mode (the default) reads the ratios: GPU i takes the next split[i] of the offloaded layers
        shares = (ctypes.c_float * api.llama_max_devices())(*split)
        params.tensor_split = ctypes.cast(shares, type(params.tensor_split))
    no_devices = (ctypes.c_void_p * 1)()  # a list of none, its NULL end alone: llama.cpp's `--device none`
    if not placement.gpu_layers:
        # Nothing offloaded: no GPU device either, or a CUDA build would still compute large batches there (op
        # offload), keep a compute buffer there and pick its pinned host memory for the weights in RAM.
        params.devices = ctypes.cast(no_devices, ctypes.c_void_p)
    overrides = Overrides([(experts_pattern(placement.cpu_expert_layers()), lib.cpu_buffer_type())]
                          if placement.cpu_expert_layers() else [])
    overrides.install(params)
    stopped: list[BaseException] = []

    def on_progress(fraction, user_data) -> bool:
        # The app's loading screen cancels by raising from `progress`: a ctypes callback cannot raise, so it
        # returns False, which makes llama.cpp stop reading, and the exception is raised once it has.
        try:
            if progress:
                progress("load", min(float(fraction), 0.99))
            return True
        except BaseException as e:  # noqa: BLE001 -- handed back to the caller
            stopped.append(e)
            return False

    params.progress_callback = callback = api.llama_progress_callback(on_progress)
    handle = api.llama_model_load_from_file(str(path).encode(), params)
    del callback, overrides, no_devices, shares  # llama.cpp reads them only while loading
    return handle, stopped


def _counter(api, lib, config, placement: Placement) -> ExpertCounter:
    """The routers' picks counter for a context, told which layers' experts the placement put on the GPU."""
    return ExpertCounter(api, lib.ggml, config.num_layers, config.num_experts,
                         on_gpu=placement.experts_on_gpu(config.num_layers))


def _make_context(api, model, context: int, slots: int, batch_tokens: int, threads: int, offload_kv: bool,
                  counter) -> LlamaContext | None:
    """A context over the loaded model; None when llama.cpp could not make one (its log says why)."""
    try:
        return LlamaContext(api, model, context, slots, batch_tokens, threads, offload_kv=offload_kv, counter=counter)
    except NoContext:
        return None


def _fewer_on_gpu(shape, machine: Machine, context_length, gpu_budget, cpu_moe: int) -> tuple[Fit, Placement]:
    """The plan with the first `cpu_moe` layers' experts in RAM, and its placement saying why."""
    fit = plan(shape, machine, context_length, gpu_budget, cpu_moe)
    return fit, replace(fit.placement, why=f"experts of {cpu_moe} of {len(shape.sizes.expert_bytes)} layers in RAM: "
                                           f"the GPU could not hold more")


def _detail(log: list[str], *words: str) -> str:
    """': LINE', LINE being llama.cpp's newest log line that holds the first of `words` found; '' when none does."""
    for word in words:
        line = next((line for line in reversed(log) if word in line.lower()), None)
        if line:
            return f": {line.strip()}"
    return ""


def _gpu_allocation_failed(log: list[str]) -> bool:
    """Whether llama.cpp's load log says a buffer could not be allocated (on the GPU: the one it offloads to)."""
    return any("failed to allocate" in line or "out of memory" in line.lower() for line in log)


def _nvidia_gpus() -> int:
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return int(os.path.exists("/proc/driver/nvidia/version"))


def _generation_defaults(reader, name: str) -> dict:
    """The sampling the model recommends, as the native engine reads it (engine.load.generation_defaults)."""
    from moedesk.engine.load.generation_defaults import checked, from_gguf_metadata

    if name == "demo":  # the demo's recipe, as the native engine's demo has
        from moedesk.engine.load.demo import recipe

        return checked(recipe().get("generation", {}))
    return from_gguf_metadata(lambda key: value(reader, key))


def _meta(api, model, key: str) -> str | None:
    buffer = ctypes.create_string_buffer(512)
    n = api.llama_model_meta_val_str(model, key.encode(), buffer, 512)
    return buffer.value.decode(errors="replace") if n >= 0 else None


def _config(api, model, vocab: LlamaVocab, sizes) -> ModelConfig:
    """The model as the app describes it (layers, experts, heads), from llama.cpp's view of the file."""
    arch = _meta(api, model, "general.architecture") or "?"

    def number(key, default=0):
        value = _meta(api, model, f"{arch}.{key}")
        try:
            return int(float(value)) if value is not None else default
        except ValueError:  # a per-layer array
            return default

    layers = int(api.llama_model_n_layer(model))
    heads = int(api.llama_model_n_head(model)) or 1
    hidden = int(api.llama_model_n_embd(model))
    experts = number("expert_count")
    moe_layers = tuple(i < len(sizes.expert_bytes) and sizes.expert_bytes[i] > 0 for i in range(layers))
    return ModelConfig(arch=arch, vocab_size=vocab.n_tokens, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=int(api.llama_model_n_head_kv(model)) or heads,
                       head_dim=number("attention.key_length", hidden // heads), intermediate_size=number("feed_forward_length"),
                       rms_norm_eps=0.0, max_position_embeddings=int(api.llama_model_n_ctx_train(model)),
                       num_experts=experts if any(moe_layers) else 0,
                       num_experts_per_tok=number("expert_used_count") if any(moe_layers) else 0,
                       moe_intermediate_size=number("expert_feed_forward_length"), moe_layers=moe_layers,
                       bos_token_id=vocab.bos_token_id, eos_token_ids=tuple(sorted(vocab.eos_token_ids)))
