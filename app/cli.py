"""The `moedesk` command line: one subcommand per job, all on the same engine."""
from __future__ import annotations

import argparse
import contextlib
import math
import sys

from moedesk.engine.decoding import DRAFT_LENGTH, DRAFT_WIDTH, SPECULATIVE_MODES
from moedesk.engine.errors import MoedeskError


def _positive_int(text: str) -> int:
    """argparse type: argparse turns the ValueError into a usage error (one line, exit 2)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _gib(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:  # NaN passes every comparison, and then fails deep in the load
        raise ValueError(text)
    return value


def gpu_budget(text: str) -> float | tuple[float, ...]:
    """--gpu-budget: one figure (GiB), today's budget, or one per GPU ("16,16"), carried as a tuple; how many
    GPUs there are is checked where the engine loads (engine.offload.devices.check_device_budgets)."""
    figures = tuple(_gib(part.strip()) for part in text.split(","))
    return figures[0] if len(figures) == 1 else figures


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


_positive_int.__name__ = "positive integer"  # how argparse names the type in its message
_gib.__name__ = "GiB (a number >= 0)"
gpu_budget.__name__ = "GiB (a number >= 0, or one per GPU: 16,16)"
_finite.__name__ = "finite number"

def add_decoding_arguments(parser: argparse.ArgumentParser, beams: bool, where: str) -> None:
    """How replies decode: speculative decoding with an EAGLE head (chat and serve), beam search (chat). Every
    default is None: an unset flag leaves the app's setting (chat) or plain decoding (serve)."""
    parser.add_argument("--speculative", choices=SPECULATIVE_MODES, default=None,
                        help=f"speculative decoding {where}: a draft head guesses tokens, the model checks them in one "
                             "step, the reply is the same; greedy drafts chains, beam trees, auto only where this "
                             "machine's measured step times say it pays (default: "
                             + ("the app's setting, else off)" if beams else "off)"))
    parser.add_argument("--draft", default=None, metavar="PATH",
                        help="EAGLE draft head folder (config.json + weights; `moedesk train-draft` makes one) "
                             "(default: " + ("the app's setting, else " if beams else "")
                             + "the model's own where it has one: the demo's)")
    parser.add_argument("--draft-length", type=_positive_int, default=None, metavar="N",
                        help="tokens drafted per step (tree depth in beam mode; auto's longest) (default: 4)")
    parser.add_argument("--draft-width", type=_positive_int, default=None, metavar="K",
                        help="beam mode: children per tree node; the tree keeps N x K nodes (default: 4)")
    if beams:
        parser.add_argument("--beams", type=_positive_int, default=None, metavar="W",
                            help="beam search over W hypotheses instead of sampling (and of speculation); the best "
                                 "appears whole when the search ends (default: the app's setting, else 1: off)")
        parser.add_argument("--length-penalty", type=_finite, default=None, metavar="L",
                            help="beam search ranks sum(logprobs) / length**L, as transformers (default: the app's "
                                 "setting, else 1.0)")


def decoding_flags(args) -> dict:
    """The decoding flags that were given, as the app's settings name them (a draft path made absolute)."""
    import os

    flags = {"speculative": args.speculative, "draft_length": args.draft_length, "draft_width": args.draft_width,
             "beams": getattr(args, "beams", None), "length_penalty": getattr(args, "length_penalty", None),
             "draft": os.path.abspath(os.path.expanduser(args.draft)) if args.draft else None}
    return {k: v for k, v in flags.items() if v is not None}


def model_specs(args: argparse.Namespace) -> None:
    """--model's values as the engine loads them: a `moedesk pull` short name becomes the files it pulled
    (app.pull_catalogue.local_model; one not pulled yet raises MoedeskError), anything else stays as typed."""
    from moedesk.app.pull_catalogue import local_model

    model = getattr(args, "model", None)
    args.model_typed = model  # what serve names its models by
    if isinstance(model, str):
        args.model = local_model(model) or model
    elif isinstance(model, list):
        args.model = [local_model(m) or m for m in model]


def add_model_arguments(parser: argparse.ArgumentParser, engine: bool = True, several: bool = False,
                        key_flag: str = "--api-key") -> None:
    """The flags that say which model to load and how. engine: offer --engine (not where only the native engine
    can do the job: train-draft reads the model's hidden states). several: --model may be repeated (serve).
    key_flag: the remote server's key (serve's own --api-key is the key it asks of its clients)."""
    if several:
        parser.add_argument("--model", action="append", default=None,
                            help="'demo', a Hugging Face model folder, a .gguf file, a repo id in the local HF "
                                 "cache, or a name `moedesk pull` fetched; repeat it to serve several, the first "
                                 "loaded at start (default: demo)")
    else:
        parser.add_argument("--model", default="demo",
                            help="'demo', a Hugging Face model folder, a .gguf file, a repo id in the local HF "
                                 "cache, or a name `moedesk pull` fetched (default: demo)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="weights and activations (default: the app's weights dtype setting for chat and batch, "
                             "else float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--context", type=_positive_int, default=None, metavar="N",
                        help="longest prompt + reply per sequence in tokens (default: 4096, capped by the model)")
    parser.add_argument("--gpu-budget", type=gpu_budget, default=None, metavar="GiB",
                        help="all the GPU memory moedesk may use: the other weights, one sequence's KV cache at "
                             "--context and attention's workspace first, the most popular experts in the rest, the "
                             "others in RAM; 0: every expert in RAM (default: what the GPU has free after the other "
                             "weights, a KV cache reserve and a 10%% margin); one figure per GPU (16,16) plans "
                             "several GPUs (shown by profile; runs on one GPU for now)")
    if engine:
        parser.add_argument("--engine", choices=["auto", "native", "llama.cpp", "remote"], default=None,
                            help="what runs the model: auto takes moedesk's own engine where it implements the "
                                 "architecture, llama.cpp for a GGUF it does not; remote: the OpenAI-compatible "
                                 "server at --url (--model then gives only the tokenizer and chat template) "
                                 "(default: the app's engine setting for chat and batch, else auto)")
        parser.add_argument("--url", default=None, metavar="URL",
                            help="--engine remote: the server, e.g. http://gpu-box:8000 (vLLM, SGLang, llama-server "
                                 "or moedesk serve) (default: the app's remote URL setting)")
        parser.add_argument(key_flag, dest="remote_api_key", default=None, metavar="KEY",
                            help="--engine remote: the server's API key (default: the app's setting, else the "
                                 "MOEDESK_REMOTE_API_KEY environment variable, else none)")
    parser.add_argument("--reprofile", action="store_true",
                        help="measure expert latency and popularity again instead of using the cached ones")
    parser.add_argument("--expert-dtype", choices=["auto", "bf16", "int8", "int4"], default=None,
                        help="how routed experts are kept: auto keeps what the file holds (a GGUF's 4-8-bit blocks "
                             "as they are), bf16 the weights dtype, int8/int4 quantise 16-bit experts while loading "
                             "(q8_0/q4_0 blocks) (default: the app's expert dtype setting for chat and batch, else auto)")


def build_parser() -> argparse.ArgumentParser:
    from moedesk.app.batch import add_batch_arguments

    from moedesk import __version__

    parser = argparse.ArgumentParser(prog="moedesk", description="Run Mixture-of-Experts language models locally.")
    parser.add_argument("--version", action="version", version=f"moedesk {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chat = sub.add_parser("chat", help="open the chat app (the default command)",
                          description="Open the Textual chat app on a model.")
    add_model_arguments(chat)
    add_decoding_arguments(chat, beams=True, where="of every reply")
    download = sub.add_parser("download", help="download a model from the Hugging Face Hub (resumable)",
                              description="Download a model repo into the local Hugging Face cache; rerun to resume.")
    from moedesk.app.download import add_download_arguments

    add_download_arguments(download)
    batch = sub.add_parser("batch", help="complete every line of a JSONL file (offline batch mode)",
                           description="Complete every line of IN.jsonl into OUT.jsonl; rerun to resume.")
    add_batch_arguments(batch)
    add_model_arguments(batch)

    profile = sub.add_parser("profile", help="hardware, expert latency profile and placement",
                             description="Print this machine's hardware, profile one expert of the model on CPU and "
                                         "GPU (cached per machine, model shape and dtype), count expert popularity on "
                                         "the calibration prompts and show the placement for the GPU budget.")
    add_model_arguments(profile)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server; concurrent clients share one batch",
                           description="Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                                       "/v1/completions, /v1/models); requests decode together in one continuous "
                                       "batch.")
    add_serve_arguments(serve)
    add_model_arguments(serve, several=True, key_flag="--remote-api-key")
    train_draft = sub.add_parser("train-draft", help="train an EAGLE draft head on the model's own answers",
                                 description="The model answers a prompt set; an EAGLE-1/2 draft head learns its "
                                             "features and tokens. The folder written loads with --draft DIR.")
    from moedesk.app.train_draft_command import add_train_draft_arguments

    add_train_draft_arguments(train_draft)
    add_model_arguments(train_draft, engine=False)
    export_draft = sub.add_parser("export-draft", help="write an EAGLE-3 draft head in the layout vLLM and SGLang load",
                                  description="Copy a head made by `moedesk train-draft --head eagle3` to a folder "
                                              "vLLM's and SGLang's EAGLE-3 drafting load, with the model layers it "
                                              "reads stated in their numbering.")
    export_draft.add_argument("head", metavar="DIR", help="the head's folder (`moedesk train-draft --out DIR`)")
    export_draft.add_argument("--out", required=True, metavar="OUT", help="new or empty folder to write")
    export_draft.add_argument("--for", dest="engines", choices=("vllm", "sglang", "both"), default="both",
                              help="the engine(s) whose config keys to write (default both: one folder for either)")
    export_draft.add_argument("--target-layers", type=int, default=None, metavar="N",
                              help="the model's layer count, for heads whose config.json does not record it")
    from moedesk.app.models_command import add_arguments as add_models_commands

    add_models_commands(sub)  # list, rm, ps, pull
    add_decoding_arguments(serve, beams=False, where="of every request whose sampling allows it (a request's "
                                                      "\"moedesk\": {\"speculative\": ...} overrides it)")
    bench = sub.add_parser("bench", help="decode/prefill speed on a synthetic model of a real shape, or a GGUF file",
                           description="Random-weight model of a real MoE shape, built in memory (or a GGUF file, "
                                       "--gguf); prints tok/s and the bound the measured bandwidths allow.")
    bench.add_argument("--shape", default=None,
                       help="mixtral-8x7b (default), qwen3-30b-a3b, glm-4.5-air, gpt-oss-120b, gpt-oss-20b, "
                            "deepseek-v3, qwen3.5-35b-a3b, minimax-m2, tiny-moe, tiny-glm or tiny-qwen35")
    bench.add_argument("--layers", type=int, default=None, metavar="N", help="keep the first N layers (default: all)")
    bench.add_argument("--gpu-budget", type=gpu_budget, default=0.0, metavar="GiB",
                       help="the whole GPU's, as the app's: the weights, the KV cache of the context the runs build "
                            "and workspace first, experts the rest (default: 0, every expert in RAM); one figure per "
                            "GPU (16,16): each GPU's whole budget, the layers spread over them")
    bench.add_argument("--policy", choices=["balanced", "fiddler"], default="balanced",
                       help="how offloaded experts are split between CPU and copy-to-GPU (default: balanced)")
    bench.add_argument("--batch", type=int, default=16, metavar="N",
                       help="sequences in the batched-decode run (default: 16; 1 skips it)")
    bench.add_argument("--prefill", type=int, nargs="*", default=[512, 2048], metavar="N",
                       help="prompt lengths of the prefill runs (default: 512 2048; none skips them)")
    bench.add_argument("--context", type=_positive_int, nargs="+", default=(), metavar="N",
                       help="also measure decode and a 512-token prefill after N tokens of context, at each N (as "
                            "llama-bench's -d); --gpu-budget then counts the deepest one's KV cache")
    bench.add_argument("--decode-tokens", type=_positive_int, default=None, metavar="N",
                       help="new tokens per sequence in each decode run (default: 64; 32 with --speculative or "
                            "--beams; 128 with --model)")
    bench.add_argument("--feed", choices=["random", "greedy"], default=None,
                       help="what each decode step feeds: random tokens, as llama-bench does (default), or the "
                            "model's own greedy choice, whose trajectory decides which experts a run touches")
    bench.add_argument("--routing", choices=["model", "no-locality", "conversation"], default="model",
                       help="what routes the plain decode and prefill runs: the synthetic model's own routers "
                            "(default; random weights favour a few experts), or a replayed trace of spread routing, "
                            "with no locality or with a conversation's recent-use locality (docs/expert-cache.md)")
    bench.add_argument("--device", default="auto", help="cuda, cuda:N, cpu (the GPU tier simulated) or auto (default)")
    bench.add_argument("--expert-format", default="dense", choices=["dense", "q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4"],
                       help="experts in 16 bits (dense, default) or packed in a GGUF block format")
    bench.add_argument("--json", action="store_true", help="print the full report as JSON")
    bench.add_argument("--engine", choices=["native", "llama.cpp"], default="native",
                       help="native (default) or llama.cpp: the shape written as a GGUF file once (cached), in "
                            "--expert-format, and run through moedesk's llama.cpp engine")
    bench.add_argument("--cpu-moe", type=int, default=None, metavar="N",
                       help="llama.cpp: the first N layers' experts in RAM, as llama.cpp's --n-cpu-moe (default: "
                            "as many as --gpu-budget leaves no room for)")
    bench.add_argument("--gguf", default=None, metavar="FILE",
                       help="measure this GGUF file instead of a shape: its own weights and routing, through the "
                            "native engine as the app loads it, or through llama.cpp with --engine llama.cpp")
    spec = bench.add_argument_group("speculative decoding and beam search (instead of the runs above)")
    spec.add_argument("--speculative", action="store_true",
                      help="T(B,k), the MoESD fit, and speculative vs plain decode with an oracle draft of chosen "
                           "acceptance, greedy chains and auto, at each batch size")
    spec.add_argument("--acceptance", type=_fractions, default=(0.5, 0.7, 0.8, 0.9), metavar="A,A,...",
                      help="the oracle draft's acceptance rates (default: 0.5,0.7,0.8,0.9)")
    spec.add_argument("--batches", type=_counts, default=None, metavar="B,B,...",
                      help="batch sizes (default: 1,4,16,32; with --model 1,4,16)")
    spec.add_argument("--draft-length", type=_positive_int, default=4, metavar="N",
                      help="draft tokens per verify step, γ; T(B,k) is measured for k = 1..γ+1 (default: 4)")
    spec.add_argument("--beams", type=_positive_int, default=None, metavar="W",
                      help="beam search of W hypotheses against batched decode of W sequences, per step")
    spec.add_argument("--model", default=None, metavar="M",
                      help="measure a real model (see Models; 'demo' too) with its draft head instead of a "
                           "synthetic shape; needs --draft and --prompts")
    spec.add_argument("--draft", default=None, metavar="DIR", help="the EAGLE head's folder, with --model")
    spec.add_argument("--prompts", default=None, metavar="FILE",
                      help="JSONL or JSON list of prompts, with --model: strings, or objects with prompt_ids, "
                           "messages, turns (first turn used) or prompt")
    spec.add_argument("--max-prompts", type=_positive_int, default=None, metavar="N",
                      help="use the first N prompts (default: all)")
    spec.add_argument("--draft-width", type=_positive_int, default=4, metavar="K",
                      help="children per node of the tree whose acceptance is measured beside the chain's, with "
                           "--model (1: chain only; default: 4)")
    return parser


def _fractions(text: str) -> tuple[float, ...]:
    values = tuple(float(x) for x in text.split(","))
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise ValueError(text)
    return values


def _counts(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(x) for x in text.split(","))


_fractions.__name__ = "comma-separated numbers in [0, 1]"
_counts.__name__ = "comma-separated positive integers"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from moedesk.app.batch import AUTO_BATCH_CAP
    from moedesk.app.server import DEFAULT_MAX_QUEUE, SHUTDOWN_GRACE_S

    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 opens it to the "
                             "network, so set --api-key)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every request (default: the MOEDESK_API_KEY "
                             "environment variable, else no key)")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="without --api-key, also answer requests whose Host header names NAME (repeatable; "
                             "default: only this machine's loopback names and the --host address)")
    parser.add_argument("--cors", default=None, metavar="ORIGINS",
                        help="let web pages of these comma-separated origins call the API ('*': any; default: none)")
    parser.add_argument("--model-name", default=None, metavar="NAME",
                        help="the model id clients send and /v1/models lists for the first --model (default: the "
                             "--model value)")
    parser.add_argument("--keep-alive", default="-1", metavar="TIME",
                        help="how long a model stays loaded while idle: 5m, 30s, 1h; 0 unloads it after each "
                             "request; -1 never (default: -1; loading another model unloads an idle one anyway)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="N",
                        help=f"requests decoded together (default: as many as half the free GPU memory, or RAM "
                             f"without a GPU, holds full-context KV caches for, at most {AUTO_BATCH_CAP})")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                        help=f"requests that may wait for a free slot; more get 503 with Retry-After "
                             f"(default: {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S, metavar="S",
                        help=f"on SIGTERM or ctrl+c, replies being written get S seconds to finish; then each ends "
                             f"with an error event and [DONE] (default: {SHUTDOWN_GRACE_S:g})")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                        help="prompt tokens prefilled per step while others decode (default: 2048 on a GPU, 512 on the CPU)")


def load_engine(args, **overrides):
    from moedesk.engine.runtime import Engine

    options = dict(device=args.device, dtype=args.dtype, context_length=args.context, gpu_budget=args.gpu_budget,
                   reprofile=args.reprofile, progress=_load_progress(), expert_dtype=args.expert_dtype or "auto",
                   # no --engine (train-draft): the native engine, the one whose hidden states it reads
                   engine=(args.engine or "auto") if hasattr(args, "engine") else "native",
                   url=getattr(args, "url", None), api_key=getattr(args, "remote_api_key", None),
                   # no heat map in batch, serve or profile: llama.cpp's counting (its graph cut at each MoE layer,
                   # on a sample of the steps) would cost speed for nothing; the chat app, which shows one, counts
                   count_experts=False)
    model = overrides.pop("model", args.model)
    return Engine.load(model, **{**options, **overrides})


def _load_progress():
    """Say on stderr when a slow start-up phase (expert profile, calibration) finishes, for the impatient."""
    import time

    started = time.perf_counter()

    def progress(phase: str, fraction: float) -> None:
        if phase != "load" and fraction >= 1.0:
            print(f"moedesk: {phase} done ({time.perf_counter() - started:.1f}s)", file=sys.stderr)

    return progress


def run_batch_command(args) -> int:
    from moedesk.app.batch import check_batch_paths, run_batch, settings_from_args

    from moedesk.app.tui.settings import load_settings

    problems: list[str] = []
    app_settings = load_settings(problems=problems)
    for problem in problems:
        print(f"moedesk: settings: {problem}", file=sys.stderr)
    settings = settings_from_args(args, app_settings)
    check_batch_paths(args.input, args.output)  # before the slow model load
    engine = load_engine(args, gpu_budget=settings.gpu_budget_gib, dtype=settings.dtype,
                         engine=args.engine or app_settings.engine,
                         expert_dtype=settings.expert_dtype,
                         url=args.url or app_settings.remote_url.strip() or None,
                         api_key=args.remote_api_key or app_settings.remote_api_key.strip() or None)
    settings = settings.with_model_defaults(engine.generation_defaults)
    try:
        return run_batch(args.input, args.output, engine, settings, stderr=sys.stderr, progress=sys.stderr.isatty())
    finally:
        # On Ctrl-C the engine's decode thread (a daemon) is still inside its step: left running as the interpreter
        # exits, it is stopped inside torch's C++ and the process aborts ("terminate called without an active
        # exception", exit 134 instead of 130). Cancelling what it holds and waiting for that step ends it first.
        with contextlib.suppress(Exception):
            engine.scheduler.close(timeout=10.0)


def run_bench_command(args) -> int:
    import json

    from moedesk.bench.synthetic import format_results, run_bench

    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    if args.context and (args.model or args.draft or args.prompts or args.speculative or args.beams
                         or args.engine == "llama.cpp"):
        raise MoedeskError("bench: --context measures the native engine's plain runs; llama.cpp's depth is "
                           "llama-bench -d (tests/perf/compare_llamacpp.sh)")
    if args.feed and (args.model or args.draft or args.prompts or args.speculative or args.beams
                      or args.engine == "llama.cpp"):
        raise MoedeskError("bench: --feed chooses what the native engine's plain decode runs feed; speculation, beam "
                           "search and llama.cpp's runs decode their own choices")
    if args.routing != "model" and (args.model or args.draft or args.prompts or args.speculative or args.beams
                                    or args.engine == "llama.cpp"):
        raise MoedeskError("bench: --routing replays a trace in the native engine's plain decode and prefill runs; "
                           "speculation, beam search and llama.cpp's runs route as the model does")
    if args.gguf and args.engine == "native":
        shaped = [flag for flag, given in (("--shape", args.shape), ("--layers", args.layers),
                                           ("--policy", args.policy != "balanced"),
                                           ("--expert-format", args.expert_format != "dense"),
                                           ("--routing", args.routing != "model")) if given]
        if shaped:
            raise MoedeskError(f"bench --gguf: {', '.join(shaped)} shape a synthetic model; the file's own layers, "
                               f"formats and routers run as the engine loads them")
        if args.model or args.draft or args.prompts or args.speculative or args.beams:
            raise MoedeskError("bench --gguf: the native engine's plain decode and prefill runs on the file; "
                               "speculation, beam search and a draft head's runs take a synthetic shape or --model")
    args.shape = args.shape or "mixtral-8x7b"
    if isinstance(args.gpu_budget, tuple) and args.engine == "llama.cpp":
        raise MoedeskError("bench: one --gpu-budget figure per GPU is for the native engine; llama.cpp's split over "
                           "GPUs is its tensor split")
    if args.model or args.draft or args.prompts or args.speculative or args.beams or args.engine == "llama.cpp":
        from moedesk.bench.machine_load import CpuLoad, busy_warning

        load = CpuLoad()  # the plain runs' report says it itself; these say it after theirs
        code = _run_other_bench(args, log)
        warning = busy_warning(load.others())
        if warning:
            print(f"moedesk: {warning}", file=sys.stderr)
        return code
    report = run_bench(args.shape, args.layers, args.gpu_budget, args.device, args.decode_tokens or 64,
                       tuple(args.prefill), args.batch, args.policy, log=log, expert_format=args.expert_format,
                       contexts=tuple(args.context), feed=args.feed or "random", routing=args.routing,
                       model_file=args.gguf)
    print(json.dumps(report, indent=1) if args.json else format_results(report))
    return 0


def _run_other_bench(args, log) -> int:
    """A draft head's bench, speculative decoding or beam search, or llama.cpp's runs."""
    import json

    if args.model or args.draft or args.prompts:
        return _run_draft_bench(args, log)
    if args.speculative or args.beams:
        return _run_decoding_bench(args, log)
    from moedesk.bench import llamacpp as llama_bench

    report = llama_bench.run(args.shape, args.layers, args.expert_format, args.gpu_budget, args.cpu_moe,
                             args.device, args.decode_tokens or 64, tuple(args.prefill), args.batch,
                             model=args.gguf, log=log)
    print(json.dumps(report, indent=1) if args.json else llama_bench.format_results(report))
    return 0


def _run_decoding_bench(args, log) -> int:
    """--speculative and/or --beams on one synthetic model: built, profiled and placed once for both."""
    import json

    from moedesk.bench.synthetic import format_beam, measure_beam, prepare_synthetic
    from moedesk.bench.speculative import PROMPT_TOKENS, format_speculative, measure_speculative

    tokens = args.decode_tokens or 32
    context = PROMPT_TOKENS + tokens + 2 * (args.draft_length + 1) + 8
    # Calibrated on greedy decodes: speculation and beam search run the model's own choices (bench.feed).
    bench = prepare_synthetic(args.shape, args.layers, args.gpu_budget, args.device, context, args.policy, log,
                              args.expert_format, feed="greedy")
    report = {**bench.header(), "profile": dict(bench.profile)}
    if args.speculative:
        report["speculative"] = measure_speculative(bench, args.batches or (1, 4, 16, 32), args.acceptance,
                                                    args.draft_length, tokens, log=log)
    if args.beams:
        report["beam"] = measure_beam(bench, args.beams, tokens, PROMPT_TOKENS, log=log)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("\n\n".join(f(report) for key, f in (("speculative", format_speculative), ("beam", format_beam))
                          if key in report))
    return 0


def _run_draft_bench(args, log) -> int:
    import json
    import os

    from moedesk.bench.speculative import format_draft, load_prompts, run_draft_bench
    from moedesk.engine.decoding import shipped_draft
    from moedesk.engine.runtime import Engine

    draft = args.draft or shipped_draft(args.model)  # the demo ships its own head: measured with it by default
    if not (args.model and draft and args.prompts):
        raise MoedeskError("bench: --model and --prompts go together, with --draft unless the model is the demo")
    check_draft_folder(draft)
    if not os.path.isfile(args.prompts):  # before the model loads, not after
        raise MoedeskError(f"--prompts {args.prompts}: no such file")
    engine = Engine.load(args.model, device=args.device, gpu_budget=args.gpu_budget, progress=_load_progress())
    prompts = load_prompts(args.prompts, engine.tokenizer, args.max_prompts)
    report = run_draft_bench(engine, draft, prompts, args.batches or (1, 4, 16), args.draft_length,
                             args.draft_width, args.decode_tokens or 128, log=log)
    print(json.dumps(report, indent=1) if args.json else format_draft(report))
    return 0


def run_serve_command(args) -> int:
    import os

    import torch

    from moedesk.app.batch import auto_batch_size
    from moedesk.app.server import run_server

    for flag, value in (("--port", args.port), ("--max-queue", args.max_queue), ("--batch-size", args.batch_size),
                        ("--prefill-chunk", args.prefill_chunk)):
        if value is not None and (value < (0 if flag == "--max-queue" else 1) or flag == "--port" and value > 65535):
            raise MoedeskError(f"{flag} {value}: out of range")
    if not 0 <= args.shutdown_grace <= 3600:  # NaN fails this too
        raise MoedeskError(f"--shutdown-grace {args.shutdown_grace}: out of range (0 to 3600 seconds)")
    from moedesk.app.model_registry import parse_keep_alive

    try:
        keep_alive = parse_keep_alive(args.keep_alive)
    except ValueError as e:
        raise MoedeskError(f"--keep-alive: {e}") from None
    sources = args.model or ["demo"]
    if len(set(sources)) < len(sources):
        raise MoedeskError(f"--model: {', '.join(sorted({s for s in sources if sources.count(s) > 1}))} given twice")
    if len(sources) > 1 and (args.speculative not in (None, "off") or args.draft):
        raise MoedeskError("--speculative and --draft serve one model: give one --model with them")
    from moedesk.app.ports import check_port

    check_port(args.host, args.port)  # before the load: minutes of it, then a port in use, was the old order
    api_key = args.api_key or os.environ.get("MOEDESK_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"moedesk: warning: listening on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    import moedesk.engine.runtime  # noqa: F401 -- imported first, so the "load" time is the model's, not torch's import

    def load(source: str, progress=None):
        """A model loaded and made ready to serve: (engine, the Group its requests decode in)."""
        from moedesk.engine.interface import Group

        engine = load_engine(args, model=source, **({"progress": progress} if progress else {}))
        if args.prefill_chunk:
            engine.scheduler.prefill_chunk = args.prefill_chunk
        batch_size = args.batch_size or auto_batch_size(engine, engine.context_length)  # each GPU's room
        # Every row's KV cache up front: grown later, it would be reallocated (and the CUDA graphs captured again)
        # while clients wait, once for each client that arrives beyond the rows so far.
        try:
            engine.cache.ensure(batch_size, engine.context_length)
        except torch.OutOfMemoryError:
            print(f"moedesk: warning: no room for {batch_size} full-context KV caches up front; they grow as needed",
                  file=sys.stderr)
        return engine, Group(batch_size)

    pool = serve_pool(args, sources, load, keep_alive)
    first = pool.entries[0]
    first.engine, first.group = load(sources[0], progress=_phase_times())
    speculation = server_speculation(first.engine, args)
    return run_server(first.engine, args.host, args.port, log=lambda line: print(line, file=sys.stderr),
                      api_key=api_key, max_queue=args.max_queue, models=pool, speculation=speculation,
                      cors=tuple(o.strip() for o in (args.cors or "").split(",") if o.strip()),
                      allow_hosts=tuple(args.allow_host), grace_s=args.shutdown_grace)


def serve_pool(args, sources: list[str], load, keep_alive):
    """The served models (app.model_registry): the --model ones, and those in moedesk's models folder and the local
    Hugging Face cache, listed and found by name; each checked against the RAM available before it loads, from its
    weights' size estimate."""
    from pathlib import Path

    from moedesk.app.model_registry import Entry, ModelPool
    from moedesk.app.tui.storage import models_dir
    from moedesk.engine.load.size_estimate import summarize_path
    from moedesk.engine.selection import model_path

    from moedesk.app.pull_catalogue import local_model

    typed = getattr(args, "model_typed", None) or sources  # a pulled short name is served by that name
    names = [args.model_name or typed[0], *typed[1:]]

    def locate(name: str) -> str | None:
        own = models_dir() / name  # moedesk's own models folder, then what --model would find
        if "/" not in name.strip("/") and own.exists() and model_path(str(own)) is not None:
            return str(own)
        try:
            return local_model(name) or (name if model_path(name) is not None else None)
        except Exception:  # noqa: BLE001 -- a name that is no model (or a short name not pulled): unknown, not an error
            return None

    def discover() -> list[str]:
        from moedesk.engine.listing import gguf_models

        names = []
        try:
            found = [p for p in sorted(models_dir().iterdir())
                     if not p.name.startswith(".") and model_path(str(p)) is not None]
            firsts = set(gguf_models([p for p in found if p.suffix == ".gguf"]))  # a split GGUF is one model
            names += [p.name for p in found if p.suffix != ".gguf" or p in firsts]
        except OSError:
            pass
        try:
            from huggingface_hub import constants, scan_cache_dir

            # scan_cache_dir's own default is HF_HUB_CACHE as it was when its module was first imported
            cache = scan_cache_dir(constants.HF_HUB_CACHE)
            names += sorted(r.repo_id for r in cache.repos if r.repo_type == "model" and r.revisions)
        except Exception:  # noqa: BLE001 -- no cache yet (CacheNotFound), or an unreadable one: nothing to list
            pass
        return names

    def need(source: str) -> int | None:
        import torch

        try:
            gpu = args.device != "cpu" and torch.cuda.is_available()
            dtype = args.dtype or ("bfloat16" if gpu else "float32")
            path = model_path(source)
            if path is not None and not isinstance(args.gpu_budget, (tuple, list)):
                from moedesk.engine.selection import llama_cpp_plan

                # A GGUF llama.cpp runs: what its load would plan (its experts may sit on the GPU, its cache in RAM)
                fit = llama_cpp_plan(path, getattr(args, "engine", None) or "auto", args.device, args.context,
                                     args.gpu_budget)
                if fit is not None:
                    return fit.ram_bytes
            weights = summarize_path(Path(path)) if path is not None else None
            return weights.estimate(args.expert_dtype or "auto", dtype, gpu).ram_bytes(gpu) if weights else None
        except Exception:  # noqa: BLE001 -- what the estimate cannot read, the load reports in its own words
            return None

    return ModelPool([Entry(n, s) for n, s in zip(names, sources)], load=load, keep_alive=keep_alive, need=need,
                     locate=locate, discover=discover)


def server_speculation(engine, args):
    """The server's speculative options (app.server.Speculation) from its flags: the draft head resolved and
    loaded now, so a missing or bad one stops the start with one line, not the first request."""
    from moedesk.app.server import Speculation
    from moedesk.engine.decoding import speculative_draft

    mode = args.speculative or "off"
    if args.draft is None and mode == "off":
        return Speculation(default="off")  # requests may still ask for it, if the model has a head of its own
    draft = speculative_draft(engine, decoding_flags(args).get("draft"))
    return Speculation(default=mode, draft=draft, draft_length=args.draft_length or DRAFT_LENGTH,
                       draft_width=args.draft_width or DRAFT_WIDTH)


def _phase_times():
    """Say on stderr when each start-up phase ends, reading the weights ("load") included: a server's start-up
    is watched (tests/perf/bench_serve.py reads these lines)."""
    import time

    started, said = time.perf_counter(), set()

    def progress(phase: str, fraction: float) -> None:
        if fraction >= 1.0 and phase not in said:
            said.add(phase)
            print(f"moedesk: {phase} done ({time.perf_counter() - started:.2f}s)", file=sys.stderr, flush=True)

    return progress


def run_download_command(args) -> int:
    from moedesk.app.download import run_download_command as download

    return download(args)


def run_profile_command(args) -> int:
    from moedesk.app.profile_command import run_profile

    return run_profile(args, load_engine)


def run_train_draft_command(args) -> int:
    from moedesk.app.train_draft_command import run_train_draft

    return run_train_draft(args, load_engine)


def run_export_draft_command(args) -> int:
    from moedesk.engine.speculative.eagle_export import ENGINES, export_eagle3

    engines = ENGINES if args.engines == "both" else (args.engines,)
    out = export_eagle3(args.head, args.out, engines, args.target_layers)
    print(f"moedesk: wrote {out} (EAGLE-3, for {' and '.join(engines)}); docs/scale-out.md has the serve flags",
          file=sys.stderr)
    return 0


def check_draft_folder(draft: str | None) -> None:
    """MoedeskError (one line) unless `draft` is None or a folder holding a draft head's config.json."""
    import os

    if draft is not None and not os.path.isfile(os.path.join(draft, "config.json")):
        what = "no such folder" if not os.path.exists(draft) else "no config.json in it"
        raise MoedeskError(f"--draft {draft}: not an EAGLE draft head folder ({what}; `moedesk train-draft` makes one)")


def run_chat_command(args) -> int:
    from moedesk.app.tui import run_app

    flags = decoding_flags(args)
    check_draft_folder(flags.get("draft"))  # here, not at every reply once the app is open
    return run_app(args.model, args.device, args.dtype, args.gpu_budget, args.context, args.reprofile,
                   args.expert_dtype, **({"decoding": flags} if flags else {}),
                   **({"engine": args.engine} if args.engine else {}),
                   **{k: v for k, v in (("url", args.url), ("api_key", args.remote_api_key)) if v})


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["chat", *argv]  # `moedesk [--model M]` opens the app
    args = parser.parse_args(argv)
    try:
        commands = {"chat": run_chat_command, "download": run_download_command, "batch": run_batch_command,
                    "profile": run_profile_command,
                    "bench": run_bench_command, "serve": run_serve_command,
                    "train-draft": run_train_draft_command, "export-draft": run_export_draft_command}
        from moedesk.app.models_command import COMMANDS as model_commands

        commands.update(model_commands)
        model_specs(args)
        return commands[args.command](args)
    except MoedeskError as e:
        print(f"moedesk: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moedesk: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
