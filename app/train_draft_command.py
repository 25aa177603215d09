"""`moedesk train-draft`: train an EAGLE draft head for a model on its own answers (training.train)."""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from moedesk.engine.errors import MoedeskError

# flags that are TrainSettings fields: default None here, so that --resume can tell what was asked for
_SETTINGS_FLAGS = ("steps", "epochs", "lr", "batch_size", "max_new_tokens", "samples", "sample_temperature", "init",
                   "seed", "depths", "noise", "ce_dtype", "head", "draft_vocab", "self_prompts", "head_width",
                   "holdout")


def add_train_draft_arguments(parser: argparse.ArgumentParser) -> None:
    from moedesk.training.train import TrainSettings

    d = TrainSettings()
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="folder for the head (config.json + model.safetensors, loadable with --draft DIR) and "
                             "its training state (DIR/training: the target's answers, the last checkpoint)")
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="JSONL of {\"messages\": [...]} (chat) or {\"prompt\": \"raw text\"} lines the target "
                             "answers (default: the shipped assets/draft_prompts.jsonl)")
    parser.add_argument("--self-prompts", type=int, default=None, metavar="N",
                        help="the model also writes N requests of its own (sampled from its chat template's user "
                             "turn) and answers them with the others: more varied training data than a prompts "
                             "file, in the model's own style (default 0)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None, metavar="N", help="optimizer steps in all")
    length.add_argument("--epochs", type=float, default=None, metavar="E",
                        help=f"passes over the answers (default {d.epochs:g})")
    parser.add_argument("--lr", type=float, default=None, help=f"peak learning rate, cosine decay (default {d.lr:g})")
    parser.add_argument("--batch-size", type=int, default=None, metavar="N",
                        help=f"sequences per step (default {d.batch_size})")
    parser.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                        help=f"length of the target's answers (default {d.max_new_tokens})")
    parser.add_argument("--samples", type=int, default=None, metavar="N",
                        help=f"answers per prompt: the greedy one and N - 1 sampled (default {d.samples})")
    parser.add_argument("--sample-temperature", type=float, default=None, metavar="T",
                        help=f"temperature of the sampled answers (default {d.sample_temperature:g})")
    parser.add_argument("--init", choices=("fit", "random", "last-layer"), default=None,
                        help="fit (default): fc starts as the least-squares map from [token ; feature] to the next "
                             "feature; random; last-layer: the decoder layer starts as the target's last layer")
    parser.add_argument("--head", choices=("eagle1", "eagle3"), default=None,
                        help="eagle1 (default): drafts from the target's last hidden state through its LM head; "
                             "eagle3: from the inputs of three of its layers, through the head's own final norm and "
                             "LM head (a copy of the target's, or of its rows for --draft-vocab), trained on the "
                             "token loss alone")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="eagle3: the head drafts from the N tokens the target's answers use most, its LM head N "
                             "rows (default: the model's whole vocabulary)")
    parser.add_argument("--holdout", type=float, default=None, metavar="F",
                        help="keep this share of the prompts (chosen by a digest of each) out of training and "
                             "report the head's agreement with the model on their answers at the end, beside the "
                             "same on as many training prompts: whether more steps or more prompts may help "
                             "(default 0)")
    parser.add_argument("--head-width", type=int, default=None, metavar="N",
                        help="width of the head's MLP (default: as wide as the model's last layer's)")
    parser.add_argument("--depths", type=int, default=None, metavar="K",
                        help=f"draft steps trained per position, the later ones fed the head's own outputs "
                             f"(default {d.depths})")
    parser.add_argument("--noise", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ce-dtype", choices=("auto", "float32", "bfloat16"), default=None,
                        help="dtype of the LM-head products in the token loss, most of the arithmetic (default auto: "
                             "bfloat16 on a GPU or a CPU with native bf16, else float32)")
    parser.add_argument("--seed", type=int, default=None, help=f"data order and initialisation (default {d.seed})")
    parser.add_argument("--gen-batch-size", type=int, default=32, metavar="N",
                        help="sequences generated together while the target answers (default 32)")
    parser.add_argument("--gen-refill", type=int, default=1, metavar="N",
                        help="while the target answers, a finished answer's row waits until N rows are free, so the "
                             "next prompts prefill together in one forward (default 1: at once)")
    parser.add_argument("--checkpoint-every", type=int, default=50, metavar="N",
                        help="steps between checkpoints (default 50)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from DIR's last checkpoint with its settings, or before the first one from "
                             "the target's answers saved so far (ends where an uninterrupted run would)")


def settings_from_args(args):
    """(TrainSettings, the fields given on the command line)."""
    from moedesk.training.train import TrainSettings

    given = {name: getattr(args, name) for name in _SETTINGS_FLAGS if getattr(args, name, None) is not None}
    for name in ("steps", "batch_size", "max_new_tokens", "depths", "samples", "draft_vocab", "head_width"):
        if name in given and given[name] < 1:
            raise MoedeskError(f"--{name.replace('_', '-')} {given[name]}: must be >= 1")
    if not 0 <= given.get("holdout", 0) < 1:
        raise MoedeskError(f"--holdout {given['holdout']}: must be at least 0 and below 1")
    if given.get("self_prompts", 0) < 0:
        raise MoedeskError(f"--self-prompts {given['self_prompts']}: must be >= 0")
    for name in ("epochs", "lr", "sample_temperature"):
        if name in given and not given[name] > 0:
            raise MoedeskError(f"--{name} {given[name]}: must be > 0")
    return TrainSettings(**given), set(given)


class LineProgress:
    """Progress on stderr: one line rewritten in place on a terminal, else a line every `every` seconds."""

    def __init__(self, stream=None, every: float = 30.0):
        # sys.stderr when called, not when this module was imported (a test's captured stream may be closed by now)
        self.stream, self.every = stream or sys.stderr, every
        self.tty = self.stream.isatty()
        self.last_phase, self.last_time = None, 0.0
        self.started = time.perf_counter()

    def __call__(self, phase: str, done: int, total: int, figures: dict) -> None:
        now = time.perf_counter()
        final = done >= total
        if self.tty or final or phase != self.last_phase or now - self.last_time >= self.every:
            line = self.render(phase, done, total, figures)
            if self.tty:
                self.stream.write("\r" + line.ljust(100)[:160] + ("\n" if final else ""))
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
            self.last_phase, self.last_time = phase, now

    @staticmethod
    def render(phase, done, total, f) -> str:
        width = 24
        filled = int(width * done / max(total, 1))
        bar = "#" * filled + "." * (width - filled)
        text = {"self-prompts": "prompts written", "generate": "target answers", "features": "target features",
                "train": "training"}.get(phase, phase)
        line = f"{text} [{bar}] {done}/{total}"
        if phase == "generate" and "tokens" in f:
            line += f"  {f['tokens']} tokens  {f.get('new_tokens', f['tokens']) / max(f['s'], 1e-9):.0f} tok/s"
        if phase == "train":
            agree = f.get("agree") or []
            line += f"  loss {f['loss']:.3f}"
            if agree:
                line += "  top-1 " + "/".join(f"{a:.2f}" for a in agree)
            rate = (done - f.get("since", 0)) / max(f.get("s", 0), 1e-9)
            if rate > 0 and done < total:
                line += f"  {rate:.2f} step/s  eta {_duration((total - done) / rate)}"
        return line


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def run_train_draft(args, load_engine) -> int:
    settings, given = settings_from_args(args)
    out = Path(args.out)
    made = not out.exists()
    try:
        return _train_into(args, load_engine, settings, given, out)
    finally:
        if made:  # a run that failed before writing anything leaves no empty folder behind
            with contextlib.suppress(OSError):
                out.rmdir()


def _train_into(args, load_engine, settings, given, out: Path) -> int:
    from moedesk.training import train as T

    # the cheap checks first: a bad --out or prompts file should not wait for the model to load
    T.check_output_folder(out)
    T.load_prompts(args.prompts or T.default_prompts_path())
    if "draft_vocab" in given and not args.resume and settings.head != "eagle3":
        raise MoedeskError(f"--draft-vocab {settings.draft_vocab}: only an eagle3 head has a vocabulary of its own "
                           "(add --head eagle3)")
    if args.resume:
        saved = T.resume_settings(out)  # the last checkpoint's, or the saved answers' before the first
        for name in sorted(given):
            if name in saved and saved[name] != getattr(settings, name) and getattr(settings, name) != "auto":
                raise MoedeskError(f"--resume: {out} was trained with {name}={saved[name]!r}, not "
                                   f"{getattr(settings, name)!r}; leave the flag out or set it as before")
    if args.gen_batch_size < 1 or args.checkpoint_every < 1 or args.gen_refill < 1:
        raise MoedeskError("--gen-batch-size, --gen-refill and --checkpoint-every: must be >= 1")
    engine = load_engine(args)
    progress = LineProgress()
    log = lambda line: print(f"moedesk: {line}", file=sys.stderr)  # noqa: E731
    last = {"step": 0, "phase": None, "answers": 0}

    def tracking(phase, done, total, figures):
        last["phase"] = phase
        if phase == "train":
            last["step"] = done
        if phase == "generate":
            last["answers"] = done
        progress(phase, done, total, figures)

    try:
        summary = T.train_draft(engine, out, args.prompts, settings, resume=args.resume,
                                gen_batch_size=args.gen_batch_size, checkpoint_every=args.checkpoint_every,
                                progress=tracking, log=log, gen_refill=args.gen_refill)
    except KeyboardInterrupt:
        every = args.checkpoint_every
        if last["phase"] in ("generate", "features"):
            where = f"from the {last['answers']} answers saved" if last["phase"] == "generate" else \
                "from the saved answers"
        else:
            where = f"from the last checkpoint (step {last['step'] // every * every})"
        print(f"\nmoedesk: interrupted; `moedesk train-draft --model {args.model} --out {out} --resume` continues "
              f"{where}", file=sys.stderr)
        return 130
    f = summary["figures"]
    agree = "/".join(f"{a:.2f}" for a in f.get("agree", []))
    print(f"moedesk: wrote {out} ({summary['sequences']} answers, {summary['answer_tokens']} tokens, "
          f"{summary['steps']} steps; data {summary['data_s']:.0f}s, training {summary['train_s']:.0f}s; "
          f"last batch top-1 agreement by draft depth {agree}); use it with --draft {out}", file=sys.stderr)
    if f.get("held_out_agree"):
        held = "/".join(f"{a:.2f}" for a in f["held_out_agree"])
        prompts = summary["held_out"] // summary["settings"]["samples"]
        own = "/".join(f"{a:.2f}" for a in f["train_agree"])
        advice = T.holdout_advice(f["train_agree"], f["held_out_agree"])
        print(f"moedesk: top-1 agreement by draft depth on the answers to the {prompts} held-out prompts {held}, "
              f"to as many training prompts {own}" + (f": {advice}" if advice else ""), file=sys.stderr)
    return 0
