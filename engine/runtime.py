"""`Engine`: the one object front ends talk to. Load a model, then generate or stream."""
from __future__ import annotations

import torch

from moedesk.engine.generation.beam import BeamJob, BeamKind, BeamOptions, BeamSearch
from moedesk.engine.load.checkpoint import open_checkpoint
from moedesk.engine.model.architectures import reads_images
from moedesk.engine.generation.cuda_graphs import graphs_wanted
from moedesk.engine.errors import MoedeskError, UnsupportedModelError
from moedesk.engine.offload.expert_executor import LocalExecutor
from moedesk.engine.generation.decoder import Decoder
from moedesk.engine.generation.runner import ModelRunner
from moedesk.engine.cpu_share import CpuShare
from moedesk.engine.hardware import use_device
from moedesk.engine.openmp_pool import frees_pool
from moedesk.engine.load.loader import load_model, resolve_device, resolve_dtype
from moedesk.engine.model.embedding import table_in_host
from moedesk.engine.model.packed_linear import plan_of
from moedesk.engine.offload.gpu_budget import (BudgetSplit, ContextBudgetError, budget_holding, model_split,
                                              prefill_workspace_bytes)
from moedesk.engine.offload.orchestration import (GIB, KV_ROWS_RESERVED, ExpertOrchestra, default_expert_budget, host_bank_allocator,
                                  leave_a_core_to_the_gpu_thread)
from moedesk.engine.requests import Completion, Request, SamplingParams
from moedesk.engine.generation.scheduler import Scheduler, default_prefill_chunk
from moedesk.engine.load.tokenizer import Tokenizer
from moedesk.engine.interface import DEFAULT_CONTEXT, EngineFace
FIRST_CACHE_LENGTH = 256  # positions of the KV cache's one row at load: requests grow it to what they need


class UnreadBudgetError(ContextBudgetError):
    """The GPU budget refused from the config alone, before any weight was read: auto may still take llama.cpp."""


class Engine(EngineFace):
    """The native engine, and `Engine.load`, which returns an engine.llamacpp.engine.LlamaCppEngine instead where
    llama.cpp runs the model: front ends see either only through engine.interface.EngineFace."""

    kind = "native"
    why = "native engine"  # Engine.load says more: why this engine was chosen

    def __init__(self, model, cfg, tokenizer: Tokenizer | None, device, dtype, context_length: int, name: str):
        self.model, self.config, self.tokenizer = model, cfg, tokenizer
        self.device, self.dtype = device, dtype
        self.context_length = context_length
        self.vocab_size = cfg.vocab_size
        self.name = name
        self.executor = LocalExecutor()
        self.orchestra: ExpertOrchestra | None = None  # set when experts are split between GPU and RAM
        self.device_plan = None  # engine.offload.devices.DevicePlan when --gpu-budget named several GPUs
        self.device_links: list = []  # (from, to, engine.offload.profiler.device_link) of each cut between GPUs
        self.budget_split: BudgetSplit | None = None  # where an explicit GPU budget went (engine.offload.gpu_budget)
        self.warnings: list[str] = []  # what went less well than asked (OOM back-off, unpinned RAM), one line each
        # The model's own sampling defaults (engine.load.generation_defaults): used where the user set no value.
        self.generation_defaults: dict = {}
        stops = set(cfg.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer is not None else ())
        # The plain batch's forwards, cache and CUDA graphs; beam search and speculation hold runners of their own.
        self.runner = ModelRunner(model, device, dtype, context_length, stops, on_oom=self._on_oom,
                                  graphs=graphs_wanted(torch.device(device)), can_free=self._can_free)
        self.runner.reserve(1, min(FIRST_CACHE_LENGTH, context_length))
        # Every generation goes through the scheduler's one decode thread, which owns the cache's rows.
        self.scheduler = Scheduler(self._decoder, prefill_chunk=default_prefill_chunk(device),
                                   cpu_share=CpuShare(torch.set_num_threads, torch.get_num_threads))
        self._grammar_tokenizer = None
        self._beam: BeamSearch | None = None  # made at the first beam search; keeps its cache for the next
        self.draft_heads: dict = {}  # EAGLE heads by folder, loaded once (engine.speculative.eagle_drafter.draft_head)
        self.idle_speculators: list = []  # speculative jobs' Speculators (each a KV cache) between jobs
        self.acceptance: dict = {}  # draft -> (accepted, tested) drafts auto measured (engine.speculative.auto)

    @classmethod
    @frees_pool  # the load's torch ops leave a pool on this thread, which would throttle the decode thread's
    def load(cls, model: str, *, device: str = "auto", dtype: str | None = None,
             context_length: int | None = None, gpu_budget: float | tuple[float, ...] | None = None,
             offload: bool | None = None, reprofile: bool = False, progress=None, expert_dtype: str = "auto",
             engine: str = "auto", cpu_moe: int | None = None, url: str | None = None,
             api_key: str | None = None, count_experts: bool = True, devices=None) -> "Engine":
        """Open and load `model` (see engine.load.checkpoint.open_checkpoint). Errors are MoedeskError, one line.

        engine: auto (the native engine where it implements the architecture, llama.cpp for a GGUF it does not;
        engine.selection), native or llama.cpp. cpu_moe: llama.cpp only, the first N layers' experts in RAM
        (its --n-cpu-moe; None: chosen for the GPU budget); count_experts: llama.cpp only, count the routers' picks
        for the heat map (the native engine always counts; llama.cpp's, a sample of the decode steps, costs a
        little speed). remote: an OpenAI-compatible server at `url` generates (api_key: its key), `model` gives the
        tokenizer and chat template (engine.remote.engine.RemoteEngine).

        offload: keep routed experts in (pinned) RAM and only the most popular `gpu_budget` GiB
        of them on the GPU. Default: on for MoE models on a GPU. On the CPU it simulates the GPU
        tier (how tests run the orchestration without a GPU). gpu_budget: GiB of GPU memory for everything, split
        by engine.offload.gpu_budget.model_split (the non-expert weights, one sequence's KV cache at the whole
        context, attention's workspace and slack first, experts the rest; ContextBudgetError naming the longest
        context that fits, before the weights are read, when they do not fit); 0: every expert in RAM; None: what
        the GPU has free after the other weights, a KV cache reserve and a margin; a tuple: one figure per GPU,
        checked against the GPUs detected: an offloaded MoE model's layers then run spread over them as the
        per-device plan says (`device_plan`; engine.model.layer_devices, engine.offload.device_orchestra). devices:
        the torch devices those figures stand for (default cuda:0, cuda:1, ...; on the CPU the CPU repeated, how
        tests run the several-device path).
        expert_dtype: how routed experts are stored (auto: as the file has them, packed GGUF blocks included; bf16;
        int8 / int4: quantised while loading; engine.load.loader.expert_formats).
        """
        from moedesk.engine.selection import after_budget_refusal, after_refusal, choose_engine

        if engine == "remote":
            from moedesk.engine.remote.engine import RemoteEngine

            return RemoteEngine.load(model, url=url, api_key=api_key, context_length=context_length, progress=progress)
        budgets = None
        if isinstance(gpu_budget, (tuple, list)):  # one figure per GPU (--gpu-budget 16,16)
            from moedesk.engine.hardware import cuda_device_count
            from moedesk.engine.offload.devices import check_device_budgets

            budgets = check_device_budgets(gpu_budget, cuda_device_count() if devices is None else len(devices))
            gpu_budget = budgets[0] if len(budgets) == 1 else None  # several: budgeted per device
        choice = choose_engine(model, engine)
        if choice is None or choice.kind == "native":
            try:
                loaded = cls._load_native(model, device, dtype, context_length, gpu_budget, offload, reprofile,
                                          progress, expert_dtype,
                                          budgets=budgets if budgets and len(budgets) > 1 else None, devices=devices)
                loaded.why = choice.why if choice else f"native engine: it implements {loaded.config.arch}"
                return loaded
            except UnsupportedModelError as refusal:
                if choice is not None:
                    raise
                choice = after_refusal(refusal)
            except UnreadBudgetError as refusal:
                if choice is not None:
                    raise
                choice = after_budget_refusal(model, refusal)
        if budgets and len(budgets) > 1:
            raise MoedeskError("--gpu-budget: one figure per GPU is planned for the native engine only; the llama.cpp "
                               "engine takes one figure")
        from moedesk.engine.llamacpp.engine import LlamaCppEngine

        return LlamaCppEngine.load(choice.model, device=device, context_length=context_length, gpu_budget=gpu_budget,
                                   progress=progress, expert_dtype=expert_dtype, cpu_moe=cpu_moe, name=model,
                                   why=choice.why, count_experts=count_experts)

    @classmethod
    def _load_native(cls, model, device, dtype, context_length, gpu_budget, offload, reprofile, progress,
                     expert_dtype, budgets: tuple[float, ...] | None = None,
                     devices=None) -> "Engine":
        checkpoint = open_checkpoint(model)
        torch_device = resolve_device(device)
        if budgets:  # one figure per device: the first device loads the model, the plan spreads its layers
            devices = _plan_devices_for(torch_device, len(budgets)) if devices is None else \
                [torch.device(d) for d in devices]
            torch_device = devices[0]
        torch_dtype = resolve_dtype(dtype, torch_device, devices if budgets else None)  # each GPU must have it
        use_device(torch_device)  # the loading thread profiles and warms up on it: cuda:1 alone works too
        if gpu_budget is not None and gpu_budget < 0:
            raise MoedeskError(f"--gpu-budget {gpu_budget}: must be >= 0 GiB")
        context = context_length or DEFAULT_CONTEXT
        offload = torch_device.type == "cuda" if offload is None else offload
        warnings: list[str] = []
        if reads_images(checkpoint.config):
            warnings.append("this model also reads images; moedesk runs its text model only: images are not supported")
        allocator = host_bank_allocator(torch_dtype, torch_device.type == "cuda", warnings) if offload else None
        _check_memory(checkpoint.path, str(torch_dtype).removeprefix("torch."), expert_dtype,
                      gpu=torch_device.type == "cuda")
        if offload and not budgets and gpu_budget != 0:
            _check_gpu_holds_weights(checkpoint, gpu_budget, torch_device, torch_dtype, context)
        owner: list = []  # the device index of each layer, once the banks say what an expert takes

        def layer_devices(model, cfg, banks):
            owner[:] = _layer_owner(model, cfg, banks, budgets, torch_dtype, min(context, cfg.max_position_embeddings),
                                    _packed_plan(checkpoint, cfg, torch_device), torch_device)
            return [devices[d] for d in owner]

        net, cfg, banks = load_model(checkpoint, torch_dtype, torch_device, context, progress, allocator, expert_dtype,
                                     layer_devices=layer_devices if budgets else None)
        context = min(context, cfg.max_position_embeddings)
        spread = None
        if budgets and banks:
            from moedesk.engine.model.layer_devices import spread_model

            spread = spread_model(net, devices, owner)  # each layer's weights are on its device: this wires the runs
        elif budgets:
            warnings.append(f"--gpu-budget {','.join(f'{b:g}' for b in budgets)}: several GPUs run a model whose "
                            f"experts are offloaded (an MoE model on a GPU); this one runs on {torch_device} alone")
        tok_model = checkpoint.tokenizer
        tokenizer = None
        if tok_model is not None:
            tokenizer = Tokenizer(tok_model, checkpoint.tokenizer_config, cfg.eos_token_ids, source=str(checkpoint.path),
                                  architecture=cfg.arch)
            tokenizer.check_vocab(cfg.vocab_size)  # chat and serve refuse such a model at load, as batch does
        engine = cls(net, cfg, tokenizer, torch_device, torch_dtype, context, name=model)
        engine.warnings = warnings
        if model == "demo":
            from moedesk.engine.load.demo import recipe
            from moedesk.engine.load.generation_defaults import checked

            engine.generation_defaults = checked(recipe().get("generation", {}))
        else:
            engine.generation_defaults = checkpoint.generation_defaults
        if spread is not None:
            engine._orchestrate_devices(banks, budgets, reprofile, progress)
        elif banks:
            engine._orchestrate(banks, gpu_budget, reprofile, progress)
        return engine

    def _orchestrate(self, banks: dict, gpu_budget: float | None, reprofile: bool, progress) -> None:
        """Profile one expert, count expert popularity (both cached), place the most popular on the GPU."""
        from moedesk.engine.load.demo import cache_root

        cfg = self.config
        if self.device.type == "cuda":
            leave_a_core_to_the_gpu_thread()
        self.orchestra = orchestra = ExpertOrchestra.start(banks, self.device, self._profile_key_parts(), cache_root(),
                                                           reprofile, self.warnings, top_k=cfg.num_experts_per_tok,
                                                           dtype=self.dtype)
        self.executor = orchestra.executor
        self._calibrate(reprofile, progress)
        if gpu_budget:
            self.budget_split = self.gpu_budget_split(int(gpu_budget * GIB))
            budget = self.budget_split.experts
        elif gpu_budget == 0:
            budget = 0
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # The cache of a full context per reserved row, and what a prefill piece at that depth allocates.
            kv = KV_ROWS_RESERVED * self.context_length * self.cache.bytes_per_position()
            kv += KV_ROWS_RESERVED * getattr(self.cache, "bytes_per_row", lambda: 0)()  # a recurrent state per row
            workspace = prefill_workspace_bytes(cfg, self.scheduler.prefill_chunk or self.context_length, self.context_length,
                                                self.dtype.itemsize)
            budget = default_expert_budget(free, kv + workspace)
        else:
            budget = 0
        orchestra.place(budget)
        self.executor.stats = type(self.executor.stats)()  # calibration's work is not the user's
        if progress:
            progress("place", 1.0)

    def _profile_key_parts(self) -> tuple:
        from moedesk.engine.hardware import machine_fingerprint

        cfg = self.config
        return machine_fingerprint(), (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, str(self.dtype))

    def _calibrate(self, reprofile: bool, progress) -> None:
        """The routing's popularity on the calibration prompts (cached per model), for the placement."""
        from moedesk.engine.offload.calibration import cached_popularity
        from moedesk.engine.load.demo import cache_root

        orchestra = self.orchestra
        if progress:
            progress("profile", 1.0)
        if self.tokenizer is not None:
            key = f"{orchestra.profile_key}-{self.name.replace('/', '_')[-40:]}"
            experts = [moe.experts.num_experts for moe in self.model.moe_blocks()]
            orchestra.calibrate(cached_popularity(cache_root(), key, self.tokenizer, self._route, experts, reprofile))
        if progress:
            progress("calibrate", 1.0)

    def _orchestrate_devices(self, banks: dict, budgets: tuple[float, ...], reprofile: bool, progress) -> None:
        """_orchestrate over the devices the model's layers run on: an orchestra per device (its own profile and
        costs: engine.offload.device_orchestra), one calibration, then each device's hot experts as the per-device
        plan places them (`device_plan`)."""
        from moedesk.engine.load.demo import cache_root
        from moedesk.engine.offload.device_orchestra import DeviceOrchestra
        from moedesk.engine.offload.devices import plan_devices
        from moedesk.engine.offload.placement import LayerCosts

        cfg, spread = self.config, self.model.spread
        if self.device.type == "cuda":
            leave_a_core_to_the_gpu_thread()
        self.orchestra = orchestra = DeviceOrchestra.start(banks, spread.devices, spread.device_of_layer,
                                                           self._profile_key_parts(), cache_root(), reprofile,
                                                           self.warnings, top_k=cfg.num_experts_per_tok,
                                                           dtype=self.dtype)
        self.executor = orchestra.executor
        self._calibrate(reprofile, progress)
        costs = [None] * len(spread.devices)  # each device's placement priced by its own profile
        for part, d in zip(orchestra.parts, orchestra.device_of_part):
            # whole layers priced with the cache on too: each device's own placement (ExpertOrchestra.place) does so
            costs[d] = LayerCosts.from_model(part.costs, part.executor.whole_layers_on_device,
                                             splits_lone_tokens=part.executor.splits_lone_tokens)
        weights, kv, moe, first, last = _device_layer_sizes(self.model, cfg, self.dtype, self.context_length,
                                                            len(budgets), plan_of(self.model), self.device)
        self.device_plan = plan_devices([int(b * GIB) for b in budgets], orchestra.expert_bytes,
                                        len(orchestra.popularity[0]), orchestra.popularity, weights, kv, moe, first,
                                        last, layer_costs=costs, top_k=orchestra.top_k)
        assert self.device_plan.device_of_layer == spread.device_of_layer, "the plan moved layers after the load"
        self.device_links = _measure_links(spread, cfg.hidden_size, self.dtype)
        orchestra.place_plan(self.device_plan)
        self.executor.stats = type(self.executor.stats)()  # calibration's work is not the user's
        if progress:
            progress("place", 1.0)

    def device_plan_lines(self) -> list[str]:
        """`moedesk profile`'s lines for the per-device plan; none unless --gpu-budget named several GPUs."""
        if self.device_plan is None:
            return []
        from moedesk.engine.offload.devices import format_device_plan

        lines = format_device_plan(self.device_plan, self.orchestra.popularity)
        for part, d in zip(self.orchestra.parts, self.orchestra.device_of_part):  # what each GPU's split is priced by
            lines.append(f"  GPU {d} ({part.executor.device}): copies an expert in {part.costs.copy_expert_ms:.3f} ms, "
                         f"computes one token's in {part.costs.gpu_expert_ms(1):.3f} ms")
        for a, b, link in self.device_links:
            lines.append(f"  cut GPU {a} -> GPU {b}: one token's hidden state {link['token_ms']:.3f} ms, "
                         f"link {link['gbs']:.1f} GB/s")
        return lines

    @property
    def table_in_ram_bytes(self) -> int:
        """Bytes of the token table kept in pinned RAM beside the GPU (engine.model.embedding); 0 where the GPU, or
        without one the CPU, holds it with the rest."""
        embed = self.model.embed
        return embed.weight.numel() * embed.weight.element_size() if embed.in_host else 0

    def gpu_budget_split(self, budget: int) -> BudgetSplit:
        """How `budget` bytes of GPU would split for this model at its context, from the sizes of what it loaded
        (engine.offload.gpu_budget.model_split; ContextBudgetError when too small). The routed experts are no
        parameters of the model: its parameters and buffers are what stays on the GPU whatever the placement."""
        held = held_bytes(self.model)
        return model_split(self.config, budget, self.context_length, self.dtype.itemsize,
                           self.scheduler.prefill_chunk or self.context_length, held, self.cache.bytes_per_position(),
                           getattr(self.cache, "bytes_per_row", lambda: 0)())

    def gpu_budget_for_experts(self, count: int) -> float:
        """The least GPU budget (GiB) whose split keeps `count` experts resident beside what it holds first."""
        whole = self.gpu_budget_split(2**62)
        fixed = whole.weights + whole.kv_cache + whole.workspace
        return (budget_holding(fixed, count * self.orchestra.expert_bytes) + 16) / GIB  # 16: float rounding

    def _route(self, requests: list[Request]) -> dict:
        """Run `requests` to their end and return how often the routers picked each expert for them, by layer."""
        self.executor.selections.clear()
        list(self.generate(requests, batch_size=4))
        return self.executor.selections

    @property
    def description(self) -> str:
        cfg = self.config
        shape = f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if cfg.is_moe else "dense"
        dtype = str(self.dtype).removeprefix("torch.")
        # Experts held otherwise than the weights (packed, or a CPU load's bfloat16 ones): what decode reads most
        held = sorted({moe.experts.describe() for moe in self.model.moe_blocks()} - {dtype})
        experts = f", experts {'/'.join(held)}" if held else ""
        return f"{self.name} ({cfg.arch}, {cfg.num_layers} layers, {shape}) on {self.device.type} {dtype}{experts}"

    def expert_map(self) -> tuple[list[list[bool]], list[list[int]]]:
        """Per MoE layer and expert: is its weight on a GPU, and how often it has been selected so far."""
        on_gpu, popularity = [], []
        resident = self.executor.on_gpu() if self.orchestra else None
        for i, moe in enumerate(self.model.moe_blocks()):
            experts = moe.experts.num_experts
            on_gpu.append(resident[i] if resident else [moe.experts.device.type == "cuda"] * experts)
            counts = self.executor.selections.get(moe.layer)
            popularity.append([0] * experts if counts is None else counts.tolist())
        return on_gpu, popularity

    @property
    def cache(self):
        """The plain batch's cache (its size tells front ends what a row costs)."""
        return self.runner.cache

    @property
    def graphs(self):
        """The plain batch's CUDA graphs (engine.generation.cuda_graphs.GraphedDecode), None where decode is eager."""
        return self.runner.graphs

    def _decoder(self) -> Decoder:
        return Decoder(self.runner, self.executor, self.tokenizer)

    def _on_oom(self) -> bool:
        """Free GPU memory after an out-of-memory error in a step: experts leave the GPU, half at a time."""
        return self.orchestra is not None and self.orchestra.back_off()

    def _can_free(self) -> bool:
        """Whether `_on_oom` has experts on the GPU to move, so that a step that runs out of memory is retried."""
        placement = self.orchestra.placement if self.orchestra is not None else None
        return placement is not None and placement.experts_on_gpu > 0

    def release_cache(self, timeout: float = 30.0) -> bool:
        """Give the KV caches' memory back, once no request runs (what an out-of-memory back-off to fewer rows at
        once does: the caches only ever grow, so the rows no longer used would stay allocated): the plain batch's
        cache goes back to its size at load, the beam search's and idle speculators' caches and every CUDA graph
        over them are dropped, and the next requests allocate what they need. False when other requests kept
        the engine busy for `timeout` seconds (nothing released)."""

        def release() -> None:
            # Graphs hold memory of their own and read the old tensors: each runner drops its own.
            self.runner.shrink(1, min(FIRST_CACHE_LENGTH, self.context_length))
            if self._beam is not None:
                self._beam.runner.release_graphs()
            self._beam = None
            for spec in self.idle_speculators:  # a running job holds its own
                spec.runner.release_graphs()
            self.idle_speculators.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # back to the device, not only to torch's caching allocator

        return self.scheduler.when_idle(release, timeout)

    def expert_stats(self) -> dict:
        """Expert work so far (where experts ran, GPU hit rate, time) and the placement; {} without offload."""
        if self.orchestra is None:
            return {}
        return {**self.orchestra.summary(), **self.executor.stats.as_dict()}

    def _kind(self, decoding, limit: int | None):
        """The scheduler's JobKind for a decoding option (None for plain decoding)."""
        if decoding is None:
            return None
        if isinstance(decoding, BeamOptions):
            return BeamKind(decoding, lambda: BeamJob(self._beam_search, lambda: self.executor, self.tokenizer,
                                                      self._eos_ids))
        from moedesk.engine.speculative.job import SPECULATIVE_ROWS, SpeculativeKind
        from moedesk.engine.speculative.options import SpeculativeOptions

        if isinstance(decoding, SpeculativeOptions):
            return SpeculativeKind(self, decoding, limit or SPECULATIVE_ROWS)
        raise TypeError(f"decoding must be None, BeamOptions or SpeculativeOptions, not {type(decoding).__name__}")

    def _beam_search(self) -> BeamSearch:
        if self._beam is None:  # on the decode thread: its CUDA graphs are captured there
            self._beam = BeamSearch(self.model, self.device, self.dtype, self.context_length, on_oom=self._on_oom,
                                    graphs=self.runner.graphs is not None, can_free=self._can_free)
        return self._beam

    def _eos_ids(self) -> set:
        return set(self.runner.stop_ids)

    def beam_search(self, prompt_ids: list[int], beams: int = 4, max_new_tokens: int = 256,
                    length_penalty: float = 1.0, early_stopping: bool | str = False, ignore_eos: bool = False,
                    tag=None) -> Completion:
        """The best of `beams` hypotheses continuing `prompt_ids`, as transformers' `generate(num_beams=beams,
        do_sample=False, length_penalty=..., early_stopping=...)` chooses it (engine.generation.beam). The hypotheses
        decode as one batch through the executor, in a KV cache of their own that stays allocated for the
        next search. finish_reason "stop" when the best ended with an end-of-sequence token (left out of
        token_ids, as always), else "length". ignore_eos: no token ends a hypothesis.

        Runs on the scheduler's decode thread as a job between the steps of whatever else decodes (generate,
        stream, serve requests), which keeps going meanwhile; beam searches submitted meanwhile step with it, all
        their hypotheses in one forward (engine.generation.beam). Bad options raise here (ValueError,
        MoedeskError), before anything is queued."""
        options = BeamOptions(beams, length_penalty, early_stopping)
        if not prompt_ids:
            raise ValueError("beam search needs a prompt of at least one token")
        if len(prompt_ids) >= self.context_length:
            raise MoedeskError(f"prompt has {len(prompt_ids)} tokens; the context is {self.context_length}")
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=ignore_eos)
        return self.complete([Request(list(prompt_ids), params, tag=tag)], decoding=options)[0]

    def speculate(self, requests: list[Request], draft, mode: str = "greedy", draft_length: int = 4,
                  draft_width: int = 4, budget: int | None = None) -> list[Completion]:
        """Complete `requests` together with speculative decoding (engine.speculative.job), in input order.

        draft: an EAGLE head folder (loaded once, kept) or a drafter factory (e.g. decode.oracle_factory).
        mode greedy: chains of draft_length drafts; beam: EAGLE-2 trees of that depth, draft_width children per
        node, `budget` nodes (default length x width); auto: chains whose length each round is chosen from this
        engine's measured step times and the running acceptance, plain decoding where drafting is not
        predicted to pay. At temperature 0 the tokens are plain greedy's; otherwise the target's
        distribution. Completion.stats["speculative"]: drafted, accepted, verify_steps, tokens_per_step,
        step/draft/verify ms. Runs as one job on the scheduler's decode thread (the requests verify together),
        beside whatever else decodes."""
        from moedesk.engine.speculative.job import speculate

        return speculate(self, requests, draft, mode, draft_length, draft_width, budget)

    def speculation_step_times(self, draft_length: int, measure: bool = False, progress=None):
        """The step times T(B, k) auto prices a `stream`ed reply's rounds at: the ones measured before on this
        machine, else measured now when `measure` (a while on a CPU, hence progress(done in [0, 1]) as it goes), else
        None."""
        from moedesk.engine.speculative.job import SPECULATIVE_ROWS
        from moedesk.engine.speculative.step_times import cached_step_times, engine_step_times

        if not measure:
            return cached_step_times(self, SPECULATIVE_ROWS, draft_length)
        return engine_step_times(self, SPECULATIVE_ROWS, draft_length, progress=progress)

    def speculation_outlook(self, draft_length: int):
        """What drafting could gain a lone reply here (engine.speculative.auto.Outlook: the best draft length's
        speedup at a high acceptance, whether it loses), from the step times measured before; None if never."""
        from moedesk.engine.speculative.auto import batch_one_outlook

        table = self.speculation_step_times(draft_length)
        return batch_one_outlook(table, draft_length) if table else None

    def load_draft(self, path) -> object:
        """Load the EAGLE head at `path` for this model now (a bad folder raises one line here, not at the first
        speculative request); it is kept for every later request that names it."""
        from moedesk.engine.speculative.eagle_drafter import draft_head

        return draft_head(self, path)

    def grammar(self, response_format):
        """An OpenAI-style response_format as an engine.generation.sampling.Grammar for Request.grammar (None for plain
        text). Raises ValueError (one line) for a bad format, MoedeskError for a model without a tokenizer."""
        from moedesk.engine.generation.sampling import compile_response_format, grammar_tokenizer

        if self.tokenizer is None:
            raise MoedeskError("structured output needs the model's tokenizer")
        eos = set(self.config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size, eos)
        return compile_response_format(response_format, self._grammar_tokenizer, self.vocab_size, eos)


def default_weights_dtype(device: str, spread: int = 0) -> torch.dtype:
    """The weights dtype a native load on the GPU picks when none is named (resolve_dtype): of the GPU `device` names
    ("auto" and "cuda": the current one), or of every GPU a spread over `spread` of them runs on (one --gpu-budget
    figure each). What the app previews before loading, so that the screen and the load agree."""
    first = torch.device(device if device.startswith("cuda") else "cuda")
    return resolve_dtype(None, first, _plan_devices_for(first, spread) if spread > 1 else None)


def _plan_devices_for(device: torch.device, count: int) -> list[torch.device]:
    """The devices `count` budget figures stand for: the CUDA GPUs in order, or on the CPU the CPU `count` times
    (it stands in for the GPU tier there, as for one figure)."""
    if device.type == "cpu":
        return [device] * count
    return [torch.device("cuda", i) for i in range(count)]


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each byte once: views (fused q/k/v's parts, packed rows joined,
    engine.model.packed_linear) lie inside the tensor they view. Per storage, the span its tensors cover (not the
    storage's size: a tensor may view a little of a larger one). Not the token table where it lies in host memory
    beside a GPU (engine.model.embedding): the budget is the GPU's."""
    embed = getattr(model, "embed", None)
    in_host = {id(embed.weight)} if getattr(embed, "in_host", False) else set()
    spans: dict = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.numel() == 0 or id(t) in in_host:
            continue
        start = t.storage_offset() * t.element_size()
        end = start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
        key = (t.untyped_storage().data_ptr(), t.device)
        low, high = spans.get(key, (start, end))
        spans[key] = (min(low, start), max(high, end))
    return sum(high - low for low, high in spans.values())


def _packed_plan(checkpoint, cfg, device: torch.device) -> dict | None:
    """What a load onto `device` will keep packed of `checkpoint` (engine.load.loader.packed_plan); None where packed
    weights are not wanted (packed_linear.wanted)."""
    from moedesk.engine.load.loader import packed_plan
    from moedesk.engine.model.packed_linear import wanted

    return packed_plan(checkpoint, cfg) if wanted(device) else None


def _device_layer_sizes(model, cfg, dtype: torch.dtype, context: int, devices: int, packed: dict | None,
                        first_device):
    """engine.offload.devices.layer_sizes for this model: per layer its weights and KV cache (the default budget's
    KV_ROWS_RESERVED sequences of the whole context) and whether its experts are routed, then the embeddings (none
    where the table stays in host memory beside `first_device`) and head; `packed`: its weights kept packed
    (engine.model.packed_linear.plan_of)."""
    from moedesk.engine.offload.devices import layer_sizes

    weights, kv, _, first, last = layer_sizes(cfg, dtype.itemsize, KV_ROWS_RESERVED * context, devices, packed)
    first *= not table_in_host(cfg, first_device)
    routed = {moe.layer for moe in model.moe_blocks()}  # the layers whose popularity rows the orchestra has
    return weights, kv, [layer in routed for layer in range(cfg.num_layers)], first, last


def _measure_links(spread, hidden: int, dtype: torch.dtype) -> list:
    """(from, to, engine.offload.profiler.device_link) for each cut between two distinct devices (none between a
    device and itself, as when the CPU stands for each GPU)."""
    from moedesk.engine.offload.profiler import device_link

    held = [run[0] for run in spread.runs]
    return [(a, b, device_link(spread.devices[a], spread.devices[b], hidden, dtype))
            for a, b in zip(held, held[1:]) if spread.devices[a] != spread.devices[b]]


def _layer_owner(model, cfg, banks: dict, budgets: tuple[float, ...], dtype: torch.dtype,
                 context: int, packed: dict | None, first_device) -> tuple[int, ...]:
    """The device index of each layer as the per-device plan splits them (by sizes, before the popularity that picks
    each device's experts), asked by the loader once the banks exist, before the other weights are read."""
    from moedesk.engine.offload.devices import plan_devices

    weights, kv, moe, first, last = _device_layer_sizes(model, cfg, dtype, context, len(budgets), packed,
                                                        first_device)
    bank = next(iter(banks.values()))
    # Planned once without popularity: the split is by sizes alone, and a figure too small for its layers' weights
    # and cache is refused here (BudgetError naming the GPU), before the profile and the calibration.
    plan = plan_devices([int(b * GIB) for b in budgets], bank.expert_bytes, bank.num_experts,
                        [[0] * bank.num_experts for _ in banks], weights, kv, moe, first, last)
    return plan.device_of_layer


def available_ram() -> int:
    """The RAM available, or less where the process's cgroup (a container's limit) allows less."""
    from moedesk.engine.host_memory import available_memory

    return available_memory()


def _gpu_free_bytes(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def _check_gpu_holds_weights(checkpoint, gpu_budget: float | None, device: torch.device, dtype: torch.dtype,
                             context: int) -> None:
    """Refuse (UnreadBudgetError, one line) before any weight is read where the GPU budget, or without one what the
    GPU has free, cannot hold an MoE model's non-expert weights (16-bit, or packed where kept so) and the KV cache of
    its context: read anyway, the load ended in a CUDA out-of-memory error."""
    from moedesk.engine.memory_fit import gib
    from moedesk.engine.model.architectures import parse_config

    free = None if gpu_budget else _gpu_free_bytes(device)
    if not gpu_budget and free is None:
        return
    early = parse_config(checkpoint.config, checkpoint.path, tensors=checkpoint.shapes())
    if not early.is_moe:
        return
    context = min(context, early.max_position_embeddings)
    piece = default_prefill_chunk(device)
    packed = _packed_plan(checkpoint, early, device)  # weights kept packed, counted packed
    in_host = table_in_host(early, device)  # the token table in RAM, not counted
    if gpu_budget:
        try:
            model_split(early, int(gpu_budget * GIB), context, dtype.itemsize, piece, packed=packed,
                        table_in_host=in_host)
        except ContextBudgetError as refusal:
            raise UnreadBudgetError(str(refusal)) from None
        return
    whole = model_split(early, 2**62, context, dtype.itemsize, piece, packed=packed, table_in_host=in_host)
    need = whole.weights + whole.kv_cache + whole.workspace
    if need > free:
        raise UnreadBudgetError(f"{device} has {gib(free)} free, less than the {gib(need)} this model's non-expert "
                                f"weights and the KV cache of {context} positions take there; free GPU memory, or "
                                f"use a shorter --context or --device cpu")


def _check_memory(path, weights_dtype: str, expert_dtype: str, gpu: bool) -> None:
    """Refuse (MoedeskError, one line naming an --expert-dtype that fits) a model whose weights the RAM cannot
    hold, before reading them: read anyway, the load ended in a MemoryError traceback or the OOM killer."""
    from moedesk.engine.load.size_estimate import summarize_path
    from moedesk.engine.memory_fit import check_load_fits

    try:
        weights = summarize_path(path)
        need = weights.estimate(expert_dtype, weights_dtype, gpu).ram_bytes(gpu)
        smaller = {f"--expert-dtype {e}": weights.estimate(e, weights_dtype, gpu).ram_bytes(gpu)
                   for e in ("int8", "int4") if e != expert_dtype}
    except Exception:  # noqa: BLE001 -- what the estimate cannot read, the load reports in its own words
        return
    check_load_fits(need, available_ram(), str(path), smaller)
