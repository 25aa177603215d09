"""The `moedesk` command line: one subcommand per job, all on the same engine."""
from __future__ import annotations

import argparse
import sys

from engine.errors import MoedeskError


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="demo",
                        help="'demo', a Hugging Face model folder, a .gguf file, or a repo id in the local HF cache "
                             "(default: demo)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="weights and activations (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help="longest prompt + reply per sequence in tokens (default: 4096, capped by the model)")


def build_parser() -> argparse.ArgumentParser:
    from app.batch import add_batch_arguments

    parser = argparse.ArgumentParser(prog="moedesk", description="Run Mixture-of-Experts language models locally.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    batch = sub.add_parser("batch", help="complete every line of a JSONL file (offline batch mode)",
                           description="Complete every line of IN.jsonl into OUT.jsonl; rerun to resume.")
    add_batch_arguments(batch)
    add_model_arguments(batch)
    return parser


def load_engine(args):
    from engine.runtime import Engine

    return Engine.load(args.model, device=args.device, dtype=args.dtype, context_length=args.context)


def run_batch_command(args) -> int:
    from app.batch import check_batch_paths, run_batch, settings_from_args

    settings = settings_from_args(args)
    check_batch_paths(args.input, args.output)  # before the slow model load
    engine = load_engine(args)
    return run_batch(args.input, args.output, engine, settings, stderr=sys.stderr, progress=sys.stderr.isatty())


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return {"batch": run_batch_command}[args.command](args)
    except MoedeskError as e:
        print(f"moedesk: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moedesk: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
