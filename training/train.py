"""Training an EAGLE-1/2 or EAGLE-3 draft head on a target model's own features (`moedesk train-draft`).

Data. The target answers a prompt set greedily through the engine's own generation path (chat template
applied), then one teacher-forced forward over prompt + answer records its feature at every position (the
last hidden state after the final norm: what the head drafts from, engine.speculative.eagle). The head
learns what the target would do, not what a dataset says, so its drafts are accepted as often as possible.
The answers are saved as they complete (AnswerLog), so an interrupted generation continues where it stopped.
settings.self_prompts adds requests the target writes itself (training.self_prompts) to the prompt set.

Loss, as the EAGLE paper: at every answer position, a smooth-L1 loss between the head's output and the
target's next feature, plus 0.1 x the cross-entropy of the head's next-token distribution (through the
target's own frozen LM head) against the target's distribution there.

Drafting from its own outputs. At draft time only the first draft comes from a row fed the target's
feature; draft k+1 comes from a row fed the head's own output of the row before, attending to the target
rows up to the root and to the k draft rows of its chain. Training only on target features leaves those
rows untrained, so every batch is also run `depths - 1` more times in parallel, each pass fed the previous
pass's outputs shifted one position, with the attention mask a chain draft would see (EAGLE-3's
"training-time test"); pass k's loss is weighted by depth_decay**k.

EAGLE-3 (settings.head "eagle3"). The features are the residual stream entering three of the target's layers
(eagle3_feature_layers, concatenated: what decoding asks the target for), and the target's last hidden state is kept
beside them only to give its next-token distribution. The head (engine.speculative.eagle's EAGLE-3 layout) is
trained on the cross-entropy alone, through its own final norm and its LM head (a frozen copy of the target's rows
for its draft vocabulary: _init_eagle3), with the same unrolled passes: pass k > 0 is fed the head's own outputs as
they are, as drafting feeds them (EagleHead.forward's from_target=False).

Draft vocabulary (settings.draft_vocab N, eagle3 only; 0: the target's whole vocabulary, d2t all zero). The N target
tokens the answers most often ask the head to predict (draft_vocabulary), in id order: draft id i is target id
i + d2t[i], t2d marks them, and the LM head has their N rows. As EAGLE-3 and SpecForge train such heads, the
target's distribution is renormalised over those N tokens (softmax of its logits there) and rows where the target's
most likely token lies outside them are left out of the loss (target_in_draft_vocab): the head cannot propose that
token, and a softmax over the others would teach it a confident wrong draft. Drafting stays lossless whatever the
vocabulary (verification maps draft ids to target ids and samples from the target's residual).

Determinism. The data order, the noise and the optimizer depend only on the seed and the step, and a
checkpoint (safetensors: fp32 weights and AdamW moments; the step and settings in its metadata) holds all
the state there is, so a run resumed from a checkpoint ends exactly where an uninterrupted run does.
Checkpoints and the head are written atomically (a temporary file, then os.replace).
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from moedesk.engine.errors import MoedeskError
from moedesk.engine.json_cache import unwritable
from moedesk.engine.model.transformer import apply_rope
from moedesk.engine.speculative.eagle import EagleConfig, EagleHead, checkpoint_tensors, config_dict, eagle3_feature_layers
from moedesk.training.files import atomic_write
from moedesk.training.self_prompts import self_written_prompts

DATA_FORMAT = 1
ANSWERS_FORMAT = 1
CHECKPOINT_FORMAT = 1
HEADS = ("eagle1", "eagle3")
TRAINING_DIR = "training"  # under --out: answers, data, checkpoint, state (the head itself sits at the top)
ANSWERS_FILE = "answers.jsonl"  # under TRAINING_DIR: the target's answers as they complete (AnswerLog)

Progress = Callable[[str, int, int, dict], None]  # (phase, done, total, figures)


@dataclass
class TrainSettings:
    """What a run does; saved in every checkpoint, so --resume continues the same run."""

    epochs: float = 3.0
    steps: int | None = None  # optimizer steps in all; None: from epochs
    lr: float = 1e-3
    min_lr: float = 1e-4  # cosine decay ends here
    warmup: int = 20  # steps of linear warm-up
    batch_size: int = 4  # sequences per step (on the demo 4 learnt more per second than 8)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    depths: int = 4  # passes per batch: the target-fed one and depths - 1 fed the head's own outputs
    depth_decay: float = 0.8
    # cross-entropy's weight beside the feature loss: EAGLE's 0.1 learnt top-1 agreement more slowly on the demo
    # (0.14 against 0.20 after 60-100 steps); the feature loss still keeps the drafts' inputs in distribution
    token_weight: float = 1.0
    noise: float = 0.0  # uniform noise of this half-width on the target features fed in
    seed: int = 0
    init: str = "fit"  # or "random", "last-layer" (init_head)
    max_new_tokens: int = 256  # length of the target's answers
    # answers per prompt: the greedy one, then samples - 1 drawn at sample_temperature (top-p 0.95). A few hundred
    # prompts give a few hundred greedy answers, too few for one decoder layer; sampled answers are more of the
    # target's own text, and the head still learns the greedy next token at every row of them.
    samples: int = 1
    sample_temperature: float = 0.8
    # the LM-head products of the cross-entropy, most of the training's arithmetic (resolve_ce_dtype)
    ce_dtype: str = "auto"
    # the token loss's softmax over the tokens the data holds ("data": a fraction of the vocabulary, and so of the
    # arithmetic that dominates a step) or over the whole vocabulary ("full"). Drafting still scores every token:
    # the feature loss keeps the head's output near the target's, whose logits for tokens its answers never
    # use are low.
    vocab: str = "data"
    # "eagle1": the head drafts from the target's last hidden state through the target's LM head (the shipped
    # demo head). "eagle3": from the residual stream entering three of its layers, through its own final norm and
    # LM head, trained on the token loss alone (EAGLE-3; see "EAGLE-3" in the module docstring)
    head: str = "eagle1"
    # eagle3 only: the head's own vocabulary, the draft_vocab target tokens its training answers most often ask it
    # to predict (draft_vocabulary); 0: the target's whole vocabulary. Its LM head then has that many rows (the
    # demo's 49k-row one is most of a 64 MB head), its softmax runs over them, and rows where the target's most
    # likely next token is outside them are left out of the loss (EAGLE-3's and SpecForge's rule)
    draft_vocab: int = 0
    # requests the target writes itself (training.self_prompts), added to the prompt set: many more, and
    # more varied, than a shipped file holds
    self_prompts: int = 0
    # the head's MLP width; 0: the target's last layer's. A wider one learns more of what the target does, at a
    # cost that stays small beside a target forward (one layer, drafting on the GPU)
    head_width: int = 0
    # share of the prompts kept out of training (held_out_sequences), on whose answers the head's top-1 agreement
    # is measured at the end: how well it does on prompts it never saw, beside the training batches' figure
    holdout: float = 0.0

    def total_steps(self, sequences: int) -> int:
        if self.steps is not None:
            return self.steps
        return max(1, math.ceil(self.epochs * math.ceil(sequences / self.batch_size)))


# --- prompts -------------------------------------------------------------------------------------

def default_prompts_path() -> Path:
    from importlib import resources

    return Path(str(resources.files("moedesk.assets").joinpath("draft_prompts.jsonl")))


def load_prompts(path) -> list:
    """Prompts from a JSONL file: {"messages": [...]} (through the chat template) or {"prompt": "raw text"}, as
    `moedesk batch` reads them; other keys are ignored. A bad line raises MoedeskError naming it."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise MoedeskError(f"{path}: no such prompts file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MoedeskError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise MoedeskError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(item, dict):
            raise MoedeskError(f"{where}: expected a JSON object with 'messages' or 'prompt'")
        if "messages" in item:
            messages = item["messages"]
            if (not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages)):
                raise MoedeskError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
            prompts.append(messages)
        elif isinstance(item.get("prompt"), str) and item["prompt"]:
            prompts.append(item["prompt"])
        else:
            raise MoedeskError(f"{where}: needs 'messages' (a chat) or 'prompt' (non-empty raw text)")
    if not prompts:
        raise MoedeskError(f"{path}: no prompts")
    return prompts


def prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return tokenizer.chat_prompt(prompt)


# --- data: the target's answers and features -----------------------------------------------------

@dataclass
class DraftData:
    """Sequences (prompt + the target's greedy answer) and the target's feature at every position."""

    tokens: torch.Tensor  # [N] long, all sequences one after another
    offsets: torch.Tensor  # [S + 1]
    answer_start: torch.Tensor  # [S]: position of a sequence's first answer token (= its prompt length)
    loss_end: torch.Tensor  # [S]: rows p < loss_end train (the row after an EOS drafts nothing)
    features: torch.Tensor  # [N, d] float32 (eagle1); [N, 3d] bfloat16 (eagle3: the three layers' inputs)
    final: torch.Tensor | None = None  # eagle3 only: [N, d] bfloat16, the last hidden state (its token loss)

    @property
    def sequences(self) -> int:
        return len(self.answer_start)

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.features[a:b]

    def answer_tokens(self) -> int:
        return int((self.offsets[1:] - self.offsets[:-1] - self.answer_start).sum())


def data_key(engine, prompts, max_new_tokens: int, samples: int = 1, sample_temperature: float = 0.8,
             head: str = "eagle1") -> str:
    """What the data depends on: the model, the prompts, the answer length, the sampled answers and the features
    (named only for eagle3, so the keys of data made before heads had kinds still match)."""
    extra = [samples, sample_temperature] if samples > 1 else []
    extra += ["eagle3"] if head == "eagle3" else []
    raw = json.dumps([DATA_FORMAT, engine.name, engine.config.vocab_size, engine.config.hidden_size,
                      engine.config.num_layers, str(engine.dtype), max_new_tokens, prompts] + extra)
    return hashlib.sha256(raw.encode()).hexdigest()


def answers_key(engine, max_new_tokens: int, sample_temperature: float = 0.8, head: str = "eagle1") -> str:
    """data_key less the prompts and the number of samples: what an answer depends on besides its own prompt and
    sample number, so that answers outlive a change to the prompt set or to --samples (AnswerLog)."""
    raw = json.dumps([ANSWERS_FORMAT, engine.name, engine.config.vocab_size, engine.config.hidden_size,
                      engine.config.num_layers, str(engine.dtype), max_new_tokens, sample_temperature, head])
    return hashlib.sha256(raw.encode()).hexdigest()


def prompt_digests(prompts) -> list[str]:
    """A short digest of each prompt, as data_key serialises it: which saved answers a changed prompt set keeps."""
    return [hashlib.sha256(json.dumps(p).encode()).hexdigest()[:16] for p in prompts]


def held_out_sequences(prompts, samples: int, share: float) -> list[int]:
    """The sequences (every sample) of the prompts held out of training: those whose digest, read as a number in
    [0, 1), is below `share`. Each prompt is in or out by itself, so a grown or reordered set holds out the same
    prompts it held out before."""
    if share <= 0:
        return []
    return [p * samples + k for p, digest in enumerate(prompt_digests(prompts))
            if int(digest[:8], 16) / 2 ** 32 < share for k in range(samples)]


def generate_data(engine, prompts, max_new_tokens: int, batch_size: int = 32, progress: Progress | None = None,
                  feature_batch: int = 8, samples: int = 1, sample_temperature: float = 0.8,
                  saved: dict[int, tuple[list[int], bool]] | None = None,
                  on_answer: Callable[[int, list[int], bool], None] | None = None, refill: int = 1,
                  head: str = "eagle1") -> DraftData:
    """The target's answers to `prompts` (Engine.generate, the normal path): the greedy one and `samples` - 1
    sampled ones per prompt (seeded, so the data is reproducible), and its features over them.

    saved: answers already made, {request index: (token ids, stopped at an EOS)} (an AnswerLog's): those
    requests are not generated again. on_answer(index, token ids, stopped) is called as each new answer
    completes (AnswerLog.add), before `progress` hears of it. Every request is seeded on its own and sampled
    independently of the others in its batch, so the answers do not depend on which were saved. refill: freed
    rows wait until that many are free, so newcomers prefill together (Engine.generate). head: which features are
    kept (DraftData)."""
    from moedesk.engine.requests import Request, SamplingParams

    if engine.tokenizer is None:
        raise MoedeskError(f"{engine.name}: the model has no tokenizer; train-draft needs one to read the prompts")
    requests, limit = [], engine.context_length - 1
    for i, p in enumerate(prompts):
        ids = prompt_ids(engine.tokenizer, p)
        if len(ids) >= limit:
            raise MoedeskError(f"prompt {i + 1} has {len(ids)} tokens; the context is {engine.context_length}")
        for k in range(samples):
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0 if k == 0 else sample_temperature,
                                    top_p=1.0 if k == 0 else 0.95, seed=k)
            requests.append(Request(ids, params, tag=len(requests)))
    answers: dict[int, list[int]] = {}
    stopped: dict[int, bool] = {}
    for i, (ids, stop) in (saved or {}).items():
        if 0 <= i < len(requests):
            answers[i], stopped[i] = list(ids), bool(stop)
    eos = min(engine.tokenizer.eos_token_ids | frozenset(engine.config.eos_token_ids), default=None)
    started = time.perf_counter()
    tokens = sum(map(len, answers.values()))
    new_tokens = 0
    todo = [r for r in requests if r.tag not in answers]
    for c in engine.generate(todo, batch_size=batch_size, refill=refill) if todo else ():
        answers[c.tag] = list(c.token_ids)
        stopped[c.tag] = c.finish_reason == "stop" and eos is not None
        if on_answer:
            on_answer(c.tag, answers[c.tag], stopped[c.tag])
        tokens += len(c.token_ids)
        new_tokens += len(c.token_ids)
        if progress:
            progress("generate", len(answers), len(requests),
                     {"tokens": tokens, "new_tokens": new_tokens, "s": time.perf_counter() - started})
    seqs, starts, ends = [], [], []
    for i, r in enumerate(requests):
        answer = answers[i] + ([eos] if stopped[i] else [])
        seq = list(r.prompt_ids) + answer
        seq = seq[:engine.context_length]
        seqs.append(seq)
        starts.append(len(r.prompt_ids))
        # with an EOS last, its own row would draft what follows the end: the row before it is the last to train
        ends.append(len(seq) - (2 if stopped[i] else 1))
    features, final = _head_features(engine, seqs, feature_batch, progress, head)
    lengths = torch.tensor([0] + [len(s) for s in seqs])
    return DraftData(tokens=torch.tensor([t for s in seqs for t in s], dtype=torch.long),
                     offsets=torch.cumsum(lengths, 0), answer_start=torch.tensor(starts),
                     loss_end=torch.tensor(ends), features=features, final=final)


class AnswerLog:
    """The target's answers saved as they complete, so an interrupted generation continues where it stopped.

    A JSONL file: a header line {"format", "key" (data_key), "requests", "settings"}, then one line per finished
    answer {"i": request index, "ids": [token ids], "stop": ended at an EOS}, in completion order. Lines are
    appended and flushed one at a time, so a run killed at any moment leaves every answer it finished and at most
    a partial last line, which reading drops (that answer is generated again). Only token ids: small, and
    nothing pickled.

    Answers outlive a change to the prompt set or to the number of samples when the log is given `base_key`
    (answers_key), `prompts` (prompt_digests) and `samples`, which the header then records: a file made for another
    key but the same base key gives each saved answer whose prompt is still in the set, and whose sample number is
    still asked for, to its new request (request p * samples + k is prompt p's sample k; each is seeded by k alone),
    and drops the others. So a grown set answers only its new prompts."""

    def __init__(self, path: Path, key: str, requests: int, max_new_tokens: int, settings: dict | None = None,
                 base_key: str | None = None, prompts: list[str] | None = None, samples: int = 1):
        self.path, self.key, self.requests, self.max_new_tokens = Path(path), key, requests, max_new_tokens
        self.settings = settings or {}
        self.base_key, self.prompts, self.samples = base_key, prompts, samples
        self.moved = 0  # answers read from a file made for another prompt set (kept for prompts still in it)
        self.answers: dict[int, tuple[list[int], bool]] = {}
        self.dropped = 0  # unreadable lines read (a partial last line)
        self._file = None
        self._clean = False  # the file on disk is exactly the header and the answers read, ending in a newline

    @staticmethod
    def header(path: Path) -> dict | None:
        """The header of an answers file, or None when there is none readable."""
        try:
            with open(path, "rb") as f:
                line = f.readline()
            head = json.loads(line) if line.endswith(b"\n") else None
        except (OSError, ValueError):
            return None
        return head if isinstance(head, dict) and head.get("format") == ANSWERS_FORMAT else None

    def load(self) -> int:
        """Read the saved answers when the file was made for this key, or for another prompt set of this base key
        (those whose prompt is still in the set); else none. Returns how many."""
        self.answers, self.dropped, self.moved, self._clean = {}, 0, 0, False
        head = self.header(self.path)
        if head is None:
            return 0
        same = head.get("key") == self.key and head.get("requests") == self.requests
        moved = None if same else self._moved(head)
        if not same and moved is None:
            return 0
        with open(self.path, "rb") as f:
            f.readline()
            for line in f:
                answer = self._parse(line, self.requests if same else head["requests"])
                if answer is None:
                    self.dropped += 1
                elif same:
                    self.answers[answer[0]] = answer[1:]
                elif moved.get(answer[0]) is not None:
                    self.answers[moved[answer[0]]] = answer[1:]
                    self.moved += 1
        # a header naming other settings (a run that reuses the answers to train differently) is rewritten: a
        # --resume before the first checkpoint continues with this run's; so is one of another prompt set
        self._clean = same and self.dropped == 0 and head.get("settings") == self.settings
        return len(self.answers)

    def _moved(self, head: dict) -> dict[int, int | None] | None:
        """Saved request index -> this set's, for a file of another prompt set of this base key (None: not one)."""
        old, samples = head.get("prompts"), head.get("samples")
        if (self.base_key is None or self.prompts is None or head.get("base_key") != self.base_key
                or not isinstance(samples, int) or samples < 1 or not isinstance(old, list)
                or head.get("requests") != len(old) * samples):
            return None
        now: dict[str, int] = {}
        for p, digest in enumerate(self.prompts):
            now.setdefault(digest, p)
        return {p * samples + k: (now[digest] * self.samples + k if digest in now and k < self.samples else None)
                for p, digest in enumerate(old) for k in range(samples)}

    def _parse(self, line: bytes, requests: int):
        if not line.endswith(b"\n"):
            return None  # cut short by a kill mid-write
        try:
            item = json.loads(line)
            i, ids, stop = item["i"], item["ids"], item["stop"]
        except (ValueError, KeyError, TypeError):
            return None
        if (not isinstance(i, int) or not 0 <= i < requests or not isinstance(stop, bool)
                or not isinstance(ids, list) or len(ids) > self.max_new_tokens
                or not all(isinstance(t, int) and t >= 0 for t in ids)):
            return None
        return i, ids, stop

    def open(self) -> None:
        """Ready to append: the file is rewritten (atomically) with the header and the answers read unless it
        already holds exactly those."""
        if not self._clean:
            lines = [self._header_line()] + [self._line(i, ids, stop) for i, (ids, stop) in self.answers.items()]
            atomic_write(self.path, lambda tmp: tmp.write_text("".join(lines), encoding="utf-8"))
            self._clean = True
        self._file = open(self.path, "a", encoding="utf-8")

    def add(self, i: int, ids: list[int], stop: bool) -> None:
        self.answers[i] = (list(ids), bool(stop))
        self._file.write(self._line(i, ids, stop))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _header_line(self) -> str:
        head = {"format": ANSWERS_FORMAT, "key": self.key, "requests": self.requests, "settings": self.settings}
        if self.base_key is not None and self.prompts is not None:
            head.update(base_key=self.base_key, samples=self.samples, prompts=self.prompts)
        return json.dumps(head) + "\n"

    @staticmethod
    def _line(i: int, ids: list[int], stop: bool) -> str:
        return json.dumps({"i": i, "ids": ids, "stop": stop}, separators=(",", ":")) + "\n"


def _head_features(engine, seqs, batch: int, progress: Progress | None, head: str):
    """(features, final) at every position: eagle1's last hidden state in float32 (final: None, the features are
    it); eagle3's three layer inputs (the keys EagleDrafter asks the target for) and the last hidden state, in
    bfloat16. bfloat16 halves their memory (four hidden widths a token: twice eagle1's float32 one rather than four
    times) and loses nothing on a bfloat16 target, which computed them in it; on a float32 target it rounds what
    the head trains on to 8 significant bits, while decoding feeds it the float32 features (a difference of the
    order of the rounding, which one decoder layer does not resolve)."""
    if head == "eagle1":
        return _features(engine, seqs, batch, progress), None
    keys = (*eagle3_feature_layers(engine.config.num_layers), "final")
    both = _features(engine, seqs, batch, progress, keys, torch.bfloat16)
    d = engine.config.hidden_size
    return both[:, :3 * d], both[:, 3 * d:]


def _features(engine, seqs: list[list[int]], batch: int, progress: Progress | None, keys: tuple = ("final",),
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Teacher-forced forwards (batches of similar length, right-padded) keeping the hidden states `keys`
    (concatenated, in `dtype`) at every position."""
    out: list[torch.Tensor | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    done = 0
    for at in range(0, len(order), batch):
        group = order[at:at + batch]
        longest = max(len(seqs[i]) for i in group)
        tokens = torch.zeros(len(group), longest, dtype=torch.long)
        for row, i in enumerate(group):
            tokens[row, :len(seqs[i])] = torch.tensor(seqs[i])
        positions = torch.arange(longest).expand(len(group), longest)
        last = torch.tensor([len(seqs[i]) - 1 for i in group])
        cache = engine.model.new_cache(len(group), longest, engine.dtype, engine.device)
        # logits_at: one row of logits instead of [B, T, vocab], and the padding skips the experts
        _, hidden = engine.model(tokens.to(engine.device), positions.to(engine.device), cache, engine.executor,
                                 logits_at=last.to(engine.device), features=keys)
        final = torch.cat([hidden[k] for k in keys], dim=-1).to(dtype).cpu()
        for row, i in enumerate(group):
            out[i] = final[row, :len(seqs[i])].clone()  # a plain tensor, not an inference-mode one
        del cache, hidden
        done += len(group)
        if progress:
            progress("features", done, len(seqs), {})
    return torch.cat(out)


def save_data(data: DraftData, path: Path, key: str) -> None:
    from safetensors.torch import save_file

    tensors = {f.name: getattr(data, f.name).contiguous() for f in fields(DraftData)
               if getattr(data, f.name) is not None}  # eagle1's final is None: its features are it
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"key": key, "format": str(DATA_FORMAT)}))


def load_data(path: Path, key: str) -> DraftData | None:
    """The saved data if it was made from the same model, prompts and settings; else None."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("key") != key:
            return None
        tensors = load_file(str(path))
        return DraftData(**{f.name: tensors[f.name] for f in fields(DraftData)
                            if f.name in tensors or f.default is MISSING})
    except (OSError, SafetensorError, KeyError):
        return None


# --- the head -------------------------------------------------------------------------------------

def head_config(engine, head: str = "eagle1", draft_vocab: int = 0, width: int = 0) -> EagleConfig:
    """An EAGLE-1/2 (or, head "eagle3", EAGLE-3) head of the target's own attention shape; its MLP `width` wide, or
    with 0 as wide as the target's last layer's. EAGLE-3's draft vocabulary has `draft_vocab` tokens
    (draft_vocabulary), or with 0 is the target's whole one (d2t all zero, t2d all true: the identity), so its
    drafts can be any token the target could emit."""
    c = engine.config
    width = width or (c.moe_intermediate_size if c.is_moe_layer(c.num_layers - 1) else c.intermediate_size)
    three = head == "eagle3"
    return EagleConfig(version=3 if three else 1, hidden_size=c.hidden_size, intermediate_size=width,
                       num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                       rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size,
                       draft_vocab_size=(draft_vocab or c.vocab_size) if three else c.vocab_size,
                       target_hidden_size=c.hidden_size, fc_bias=not three, qkv_bias=c.attention_bias, rope=c.rope)


def predicted_token_counts(data: DraftData, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each token is one the head is trained to predict. Row p of a sequence drafts
    the token at p + 2, and the rows run from the last prompt position, so these are the answer's tokens after its
    first (which the target itself emits after the prompt; an answer's EOS counts)."""
    parts = [data.tokens[int(data.offsets[i]) + int(data.answer_start[i]) + 1:int(data.offsets[i + 1])]
             for i in range(data.sequences)]
    ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return torch.bincount(ids, minlength=vocab_size)[:vocab_size]


def draft_vocabulary(data: DraftData, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids the head is most often trained to predict (predicted_token_counts), ties broken by the
    lower id (so where the answers hold fewer distinct tokens, the lowest unused ids fill it, as SpecForge does),
    in increasing order: draft id i is the i-th of them."""
    if not 1 <= size <= vocab_size:
        raise MoedeskError(f"--draft-vocab {size}: must be from 1 to the model's vocabulary ({vocab_size})")
    counts = predicted_token_counts(data, vocab_size)
    order = torch.sort(-counts, stable=True).indices  # most frequent first; a stable sort keeps ties in id order
    return order[:size].sort().values


def target_in_draft_vocab(head: EagleHead, lm_head: torch.Tensor, data: DraftData, dtype=torch.float32,
                          device="cpu", chunk: int = 1024) -> torch.Tensor:
    """[len(data.tokens)] bool: whether the target's most likely next token at each position (from its last hidden
    state there and its whole LM head `lm_head`) is in the head's draft vocabulary; computed at the positions whose
    distribution some training row matches (row p matches the target's distribution at p + 1), False elsewhere."""
    keep = torch.zeros(len(data.tokens), dtype=torch.bool)
    spans = [int(data.offsets[i]) + torch.arange(int(data.answer_start[i]), int(data.loss_end[i]) + 1)
             for i in range(data.sequences)]
    at = torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)
    if data.final is None or len(at) == 0:
        return keep
    t2d = head.t2d.cpu()
    w = lm_head.detach().to(device=device, dtype=dtype)
    with torch.no_grad():
        for start in range(0, len(at), chunk):
            q = at[start:start + chunk]
            best = (data.final[q].to(device=device, dtype=dtype) @ w.T).argmax(dim=-1).cpu()
            keep[q] = t2d[best]
    return keep


INITS = ("fit", "random", "last-layer")


def init_head(engine, cfg: EagleConfig, init: str, seed: int, sample_ids: list[int] | None = None,
              data: "DraftData | None" = None, draft_ids: torch.Tensor | None = None) -> EagleHead:
    """A new head in float32 on the engine's device.

    "fit" (the default): fc starts as the least-squares map from [token embedding ; feature] to the next feature
    over the data (`_fit_fc`), the attention and MLP outputs at zero, so training starts from the best linear
    draft instead of from noise. "random": small random weights. "last-layer": the decoder layer starts as the
    target's last layer where the shapes allow (attention unless it has q/k norms; the MLP, or for an MoE layer
    its expert 0, which in the upcycled demo is the dense MLP), rescaled from the residual stream's RMS (~36 on
    the demo) to the final features' (~2) that the head runs at, fc passing the feature through.

    On the demo "fit" starts where random weights arrive only after hundreds of steps, and stays ahead
    (docs/measurements.md, "The draft-head trainer"). The copied last layer maps a residual stream to the next
    layer's, not a final feature to the next position's, so it is no better a start than noise."""
    if init not in INITS:
        raise MoedeskError(f"--init {init!r}: expected one of {', '.join(INITS)}")
    if cfg.version == 3:
        return _init_eagle3(engine, cfg, init, seed, draft_ids)
    if init == "fit" and data is None:
        raise ValueError("init 'fit' needs the data")
    head = _seeded_head(cfg, seed)
    with torch.no_grad():
        if init == "fit":
            _fit_fc(head, data, engine.model.embed.weight.detach())
            # the layer's two branches start silent, so the head starts as the fitted map and training adds to it
            head.attn.wo.weight.zero_()
            head.mlp.down.weight.zero_()
            return head.to(device=engine.device, dtype=torch.float32)
        feature, residual, embedding = _scales(engine, sample_ids)  # a forward of the target: only these need it
        if init == "last-layer":
            _copy_last_layer(engine, head, feature, residual, embedding)
        else:
            # the token matters as much as the feature, but its embedding is far smaller (the demo's: same section):
            # equal weights would hide it until Adam had grown them over hundreds of steps
            head.fc.weight[:, :cfg.hidden_size] *= feature / max(embedding, 1e-6)
    return head.to(device=engine.device, dtype=torch.float32)


def _seeded_head(cfg: EagleConfig, seed: int) -> EagleHead:
    """A head of small random weights drawn from the seed in the parameters' order (norms 1, biases 0)."""
    g = torch.Generator().manual_seed(seed)
    head = EagleHead(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return head


def _init_eagle3(engine, cfg: EagleConfig, init: str, seed: int, draft_ids: torch.Tensor | None = None) -> EagleHead:
    """An EAGLE-3 head: the final norm and LM head copied from the target's (the rows of `draft_ids`, its draft
    vocabulary in increasing order, where that is not the whole vocabulary), the LM head frozen (see below).

    "fit" (the default; nothing is fitted, the name is the setting's): fc passes the last of the three features,
    the residual stream entering layer L-3, through, and the attention and MLP outputs start at zero. The head then
    starts as the target's "logit lens" at layer L-3 (its final norm and LM head applied three layers early), a
    prediction in the target's own vocabulary space rather than noise; the fc columns of the two shallower layers
    and the silent branches grow from the token loss. The residual stream keeps its scale, which is also the scale
    of the head's own outputs that later draft steps are fed. "random": fc random as well.
    "last-layer" is refused: its rescaling is made for eagle1's final-norm features.

    The LM head stays the target's (its rows for the draft vocabulary): already the right map to those tokens, and
    the trainable final norm adapts the head's outputs to it. Training it too would add draft-vocab x d weights,
    learnt from the few thousand tokens the answers use, and double the arithmetic of the token loss, the bulk of a
    step (EAGLE-3 and SpecForge train theirs, from random weights). Everything random is drawn from the seed, in the
    parameters' order."""
    if init == "last-layer":
        raise MoedeskError("--init last-layer: not for an eagle3 head (fit or random)")
    head = _seeded_head(cfg, seed)
    d = cfg.hidden_size
    with torch.no_grad():
        if init == "fit":
            head.fc.weight.zero_()
            head.fc.weight[:, 2 * d:] = torch.eye(d)
            head.attn.wo.weight.zero_()
            head.mlp.down.weight.zero_()
        head.norm.weight.copy_(engine.model.norm.weight.detach().float().cpu())
        ids = torch.arange(cfg.vocab_size) if draft_ids is None else draft_ids.cpu().long()
        if len(ids) != cfg.draft_vocab_size or (len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all())):
            raise ValueError(f"draft_ids: {cfg.draft_vocab_size} target ids in increasing order expected")
        lm = engine.model.lm_head.weight.detach()
        head.lm_head.weight.copy_(lm[ids.to(lm.device)].float().cpu())
        head.d2t.copy_(ids - torch.arange(len(ids)))  # draft id i is target id i + d2t[i] (zero: the whole vocabulary)
        head.t2d[ids] = True
    head.lm_head.weight.requires_grad_(False)
    return head.to(device=engine.device, dtype=torch.float32)


def _fit_fc(head: EagleHead, data: "DraftData", embed: torch.Tensor, ridge: float = 1.0) -> None:
    """fc as the least-squares map [embedding of token p+1 ; feature p ; 1] -> feature p+1 over the answer rows
    (ridge-regularised; the normal equations summed sequence by sequence, so memory stays (2d+1)^2). On the demo
    this alone agrees with the target's next token as often as hundreds of steps of training from random weights
    do (docs/measurements.md, "The draft-head trainer")."""
    d = head.cfg.hidden_size
    xtx = torch.zeros(2 * d + 1, 2 * d + 1, dtype=torch.float64)
    xty = torch.zeros(2 * d + 1, d, dtype=torch.float64)
    for i in range(data.sequences):
        tokens, feats = data.sequence(i)
        p = torch.arange(int(data.answer_start[i]) - 1, min(int(data.loss_end[i]), len(tokens) - 1))
        if len(p) == 0:
            continue
        x = torch.cat([embed[tokens[p + 1].to(embed.device)].float().cpu(), feats[p].float(),
                       torch.ones(len(p), 1)], dim=1).double()
        xtx += x.T @ x
        xty += x.T @ feats[p + 1].double()
    xtx += ridge * torch.eye(2 * d + 1, dtype=torch.float64)
    w = torch.linalg.solve(xtx, xty)  # [2d + 1, d]
    head.fc.weight.copy_(w[:2 * d].T.float())
    if head.fc.bias is not None:
        head.fc.bias.copy_(w[2 * d].float())


def _scales(engine, sample_ids) -> tuple[float, float, float]:
    """RMS of the final feature, of the residual stream entering the last layer, and of a token embedding."""
    c = engine.config
    ids = list(sample_ids or range(1, 33))[:256]
    tokens = torch.tensor([ids], device=engine.device)
    positions = torch.arange(len(ids), device=engine.device)[None]
    cache = engine.model.new_cache(1, len(ids), engine.dtype, engine.device)
    _, hidden = engine.model(tokens, positions, cache, engine.executor, features=(c.num_layers - 1, "final"))
    rms = lambda x: float(x.float().pow(2).mean(-1).sqrt().mean())  # noqa: E731
    return rms(hidden["final"]), rms(hidden[c.num_layers - 1]), rms(engine.model.embed(tokens[0]))


def _copy_last_layer(engine, head: EagleHead, feature: float, residual: float, embedding: float) -> None:
    c = engine.config
    d = c.hidden_size
    block = engine.model.layers[c.num_layers - 1]
    down = feature / residual
    if c.qk_norm is None:  # the head's attention has no q/k norm: a q/k-normed layer's projections would not fit
        norm_in = block.attn_norm.weight.detach().float().cpu() / feature
        for ours in ("wq", "wk", "wv", "wo"):
            src, dst = getattr(block.attn, ours), getattr(head.attn, ours)
            if src.weight.shape == dst.weight.shape:
                w = src.weight.detach().float().cpu()
                dst.weight.copy_(w * down if ours == "wo" else w * norm_in[None, :])
                if dst.bias is not None and src.bias is not None:
                    dst.bias.copy_(src.bias.detach().float().cpu())
    head.mlp_norm.weight.copy_(block.mlp_norm.weight.detach().float().cpu())
    if hasattr(block, "moe"):
        gate_up, w_down = block.moe.experts.expert(0).dense(torch.float32)
        gate_up, w_down = gate_up[0].cpu(), w_down[0].cpu()
        width = gate_up.shape[0] // 2
        gate, up = gate_up[:width], gate_up[width:]
    else:
        gate, up, w_down = (getattr(block.mlp, n).weight.detach().float().cpu() for n in ("gate", "up", "down"))
    if gate.shape == head.mlp.gate.weight.shape and w_down.shape == head.mlp.down.weight.shape:
        head.mlp.gate.weight.copy_(gate)
        head.mlp.up.weight.copy_(up)
        head.mlp.down.weight.copy_(w_down * down)
    head.fc.weight.zero_()
    head.fc.weight[:, d:] = torch.eye(d)
    head.fc.weight[:, :d] = torch.eye(d) * (0.5 * feature / max(embedding, 1e-6))


# --- the unrolled forward and the losses -----------------------------------------------------------

def _chain_mask(t: int, k: int, device) -> torch.Tensor:
    """[t, (k+1) t] bool: what pass k's row p sees of the passes 0..k (keys of pass j at [j t, (j+1) t)): pass 0's
    rows up to p - k (the target-fed rows up to the chain's root) and, of each pass j >= 1, the row at p - k + j
    (the chain's earlier drafts and itself) — what a chain draft attends to at inference."""
    p = torch.arange(t, device=device)
    s = torch.arange(t, device=device)
    blocks = [s[None, :] <= (p - k)[:, None]]
    for j in range(1, k + 1):
        blocks.append(s[None, :] == (p - k + j)[:, None])
    return torch.cat(blocks, dim=1)


def _layer_input(head: EagleHead, emb: torch.Tensor, feed: torch.Tensor, from_target: bool):
    """(h, the attention's input) of a row, as EagleHead.forward makes them: eagle1 fc([embedding ; feature]);
    eagle3 fc(feature) for target features and the head's own outputs as they are, the attention taking
    [embedding norm ; hidden norm]."""
    if head.cfg.version != 3:
        h = head.fc(torch.cat([emb, feed], dim=-1))
        return h, h
    h = head.fc(feed) if from_target else feed
    return h, torch.cat([head.embed_norm(emb), head.hidden_norm(h)], dim=-1)


def unrolled_forward(head: EagleHead, tokens: torch.Tensor, features: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """tokens [B, T] (row p pairs features[:, p] with tokens[:, p + 1]; the caller shifts), features [B, T, F] ->
    the head's outputs of every pass, [B, T, d] each. Pass 0 is EagleHead.forward over target features with a
    causal mask; pass k feeds row p the output of pass k - 1 at row p - 1 (from_target=False, as drafting does)."""
    cfg, attn = head.cfg, head.attn
    b, t = tokens.shape
    dtype = head.fc.weight.dtype
    emb = F.embedding(tokens, head.embed).to(dtype)
    positions = torch.arange(t, device=tokens.device).expand(b, t)
    cos, sin = attn.rope(positions, dtype)
    keys, values, outs = [], [], []
    feed = features.to(dtype)
    groups = cfg.num_heads // cfg.num_kv_heads
    for k in range(depths):
        h, x = _layer_input(head, emb, feed, k == 0)
        q = apply_rope(attn.wq(x).view(b, t, cfg.num_heads, cfg.head_dim), cos, sin)
        keys.append(apply_rope(attn.wk(x).view(b, t, cfg.num_kv_heads, cfg.head_dim), cos, sin))
        values.append(attn.wv(x).view(b, t, cfg.num_kv_heads, cfg.head_dim))
        kk = torch.cat(keys, dim=1).transpose(1, 2)
        vv = torch.cat(values, dim=1).transpose(1, 2)
        if groups > 1:
            kk, vv = kk.repeat_interleave(groups, dim=1), vv.repeat_interleave(groups, dim=1)
        mask = _chain_mask(t, k, tokens.device)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask[None, None])
        h = h + attn.wo(a.transpose(1, 2).reshape(b, t, -1))
        h = h + head.mlp(head.mlp_norm(h))
        outs.append(h)
        feed = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
    return outs


class _SoftCrossEntropy(torch.autograd.Function):
    """Cross-entropy of the head's distributions (every pass, [K, N, d] through the frozen LM head W) against the
    target's (from its features f [N, d]), weighted per pass and row by w [K, N]; in chunks of rows, so that no
    [N, vocab] tensor outlives one chunk: the gradient is computed on the way (softmax - target) @ W and kept.
    Returns (loss per pass [K], argmax agreements per pass [K])."""

    @staticmethod
    def forward(ctx, hidden, target, weight, row_weights, chunk):
        k, n, _ = hidden.shape
        grad = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        loss = torch.zeros(k, dtype=torch.float32, device=hidden.device)
        agree = torch.zeros(k, dtype=torch.float32, device=hidden.device)
        ce = weight.dtype
        for at in range(0, n, chunk):
            rows = slice(at, min(n, at + chunk))
            t_logits = (target[rows].to(ce) @ weight.T).float()
            t_probs = torch.softmax(t_logits, dim=-1)
            t_best = t_logits.argmax(dim=-1)
            for j in range(k):
                w = row_weights[j, rows]
                logits = (hidden[j, rows].to(ce) @ weight.T).float()
                logp = torch.log_softmax(logits, dim=-1)
                loss[j] += (-(t_probs * logp).sum(dim=-1) * w).sum()
                agree[j] += ((logits.argmax(dim=-1) == t_best).float() * (w > 0)).sum()
                grad[j, rows] = ((logp.exp() - t_probs) * w[:, None]).to(ce) @ weight
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(agree)
        return loss, agree

    @staticmethod
    def backward(ctx, grad_loss, grad_agree):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss[:, None, None]).to(grad.dtype), None, None, None, None


def batch_losses(head: EagleHead, lm_head: torch.Tensor, data: DraftData, batch: list[int], settings: TrainSettings,
                 noise_gen: torch.Generator | None, device,
                 keep: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The weighted loss of one batch of sequences and its figures (per-pass feature loss (eagle1 only), CE, top-1
    agreement). An eagle3 head's token loss goes through its own final norm; its LM head is the target's, frozen
    (_init_eagle3), so `lm_head` serves as both (for a draft vocabulary: the target's rows for it). keep: a
    target_in_draft_vocab mask; rows whose target position it leaves out are not trained."""
    three = head.cfg.version == 3
    tokens, feats = _padded(data, batch, data.features)
    finals = _padded(data, batch, data.final)[1] if three else feats  # the target's last hidden states
    t = tokens.shape[1]
    if settings.noise:
        feats_in = feats + (torch.rand(feats.shape, generator=noise_gen) * 2 - 1) * settings.noise
    else:
        feats_in = feats
    # row p: feature p with token p + 1, predicting feature p + 1 (eagle3: the target's last hidden state there)
    next_tokens = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
    targets = torch.cat([finals[:, 1:], finals[:, :1]], dim=1)
    p = torch.arange(t)
    starts = torch.tensor([int(data.answer_start[i]) for i in batch])
    ends = torch.tensor([int(data.loss_end[i]) for i in batch])
    # pass k's row p drafts the (k+1)-th token of a chain rooted at row p - k: the root must be an answer row
    masks = torch.stack([(p[None] >= (starts - 1 + k)[:, None]) & (p[None] < ends[:, None])
                         for k in range(settings.depths)])  # [K, B, T]
    if keep is not None:  # row p matches the target's distribution at p + 1
        ok = torch.zeros(len(batch), t, dtype=torch.bool)
        for r, i in enumerate(batch):
            a, b = int(data.offsets[i]), int(data.offsets[i + 1])
            ok[r, :b - a - 1] = keep[a + 1:b]
        masks &= ok[None]
    outs = unrolled_forward(head, next_tokens.to(device), feats_in.to(device), settings.depths)
    rows = masks[0].to(device)  # every pass's rows are among pass 0's
    hidden = torch.stack([o[rows] for o in outs])  # [K, N, d]
    target = targets.to(device)[rows]
    counts = masks.flatten(1).sum(dim=1).clamp_min(1).float()
    row_w = (masks.to(device)[:, rows] / counts.to(device)[:, None]).float()  # [K, N], each pass's rows sum to 1
    decay = torch.tensor([settings.depth_decay ** k for k in range(settings.depths)], device=device)
    if three:  # EAGLE-3 drops the feature loss: only the tokens drafted matter
        ce, agree = _SoftCrossEntropy.apply(head.norm(hidden), target, lm_head, row_w, 512)
        loss = (decay * settings.token_weight * ce).sum()
        figures = {"loss": float(loss.detach())}
    else:
        feat_rows = F.smooth_l1_loss(hidden.float(), target.float().expand_as(hidden), reduction="none").mean(dim=-1)
        feat_loss = (feat_rows * row_w).sum(dim=1)
        ce, agree = _SoftCrossEntropy.apply(hidden, target, lm_head, row_w, 512)
        loss = (decay * (feat_loss + settings.token_weight * ce)).sum()
        figures = {"loss": float(loss.detach()), "feature": feat_loss.detach().cpu().tolist()}
    figures.update(ce=ce.detach().cpu().tolist(), agree=(agree.cpu() / counts).tolist(),
                   rows=masks.flatten(1).sum(dim=1).tolist())
    return loss, figures


def _padded(data: DraftData, batch: list[int], source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's tokens [B, T] and rows of `source` (data.features or data.final) [B, T, w] in float32, the
    sequences right-padded with zeros to the longest."""
    spans = [(int(data.offsets[i]), int(data.offsets[i + 1])) for i in batch]
    t = max(b - a for a, b in spans)
    tokens = torch.zeros(len(batch), t, dtype=torch.long)
    rows = torch.zeros(len(batch), t, source.shape[1])
    for r, (a, b) in enumerate(spans):
        tokens[r, :b - a], rows[r, :b - a] = data.tokens[a:b], source[a:b]
    return tokens, rows


# --- the training loop ------------------------------------------------------------------------------

def resolve_ce_dtype(choice: str, device) -> str:
    """ "auto": bfloat16 on a GPU or on a CPU with native bf16 products (AVX512-BF16 or AMX: faster than float32,
    docs/measurements.md, "The draft-head trainer"), else float32 (emulated bf16 would be slower). From the hardware, not from a timing,
    so a run is the same run each time it starts."""
    if choice != "auto":
        return choice
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16"
    from moedesk.kernels.native_build import missing_cpu_flags

    native = any(missing_cpu_flags((flag,), flag) is None for flag in ("avx512_bf16", "amx_bf16"))
    return "bfloat16" if device.type == "cpu" and native else "float32"


def learning_rate(settings: TrainSettings, step: int, total: int) -> float:
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    span = max(1, total - settings.warmup)
    frac = min(1.0, (step - settings.warmup) / span)
    return settings.min_lr + 0.5 * (settings.lr - settings.min_lr) * (1 + math.cos(math.pi * frac))


def batch_order(data: DraftData, settings: TrainSettings, epoch: int,
                sequences: list[int] | None = None) -> list[list[int]]:
    """The batches of an epoch over `sequences` (default all): a permutation from (seed, epoch), cut into groups
    of similar length (less padding) whose order is shuffled again."""
    g = torch.Generator().manual_seed(settings.seed * 1_000_003 + epoch)
    perm = torch.randperm(data.sequences if sequences is None else len(sequences), generator=g).tolist()
    if sequences is not None:
        perm = [sequences[i] for i in perm]
    lengths = (data.offsets[1:] - data.offsets[:-1]).tolist()
    pool = settings.batch_size * 8
    batches = []
    for at in range(0, len(perm), pool):
        chunk = sorted(perm[at:at + pool], key=lambda i: lengths[i])
        batches += [chunk[j:j + settings.batch_size] for j in range(0, len(chunk), settings.batch_size)]
    shuffle = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in shuffle]


def _optimizer(head: EagleHead, settings: TrainSettings):
    params = [p for p in head.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay,
                             foreach=False)


def train(head: EagleHead, lm_head: torch.Tensor, data: DraftData, settings: TrainSettings, checkpoint: Path | None,
          resume: bool = False, checkpoint_every: int = 50, progress: Progress | None = None,
          on_checkpoint: Callable[[int], None] | None = None, held_out: list[int] | tuple = ()) -> dict:
    """Train `head` in place on `data` but its `held_out` sequences; checkpoints to `checkpoint` (a .safetensors
    path) every `checkpoint_every` steps and at the end. resume: start from that checkpoint (its settings must equal
    `settings`). Returns the last batch's figures, and with `held_out` the head's top-1 agreement by draft depth on
    those sequences at the end ("held_out_agree") and on as many trained ones ("train_agree", `comparison_sample`),
    the two that `holdout_advice` compares."""
    device = head.fc.weight.device
    ce_dtype = getattr(torch, resolve_ce_dtype(settings.ce_dtype, device))
    opt = _optimizer(head, settings)
    step = 0
    if resume:
        step = load_checkpoint(checkpoint, head, opt, settings)  # the head's draft vocabulary included
    lm, keep = lm_head.detach(), None
    if settings.vocab not in ("data", "full"):
        raise MoedeskError(f"vocab {settings.vocab!r}: expected data or full")
    if head.cfg.version == 3 and head.cfg.draft_vocab_size < head.cfg.vocab_size:
        # the softmax over the draft vocabulary, as drafting has it; rows whose target token is outside it left out
        keep = target_in_draft_vocab(head, lm, data, ce_dtype, device)
        lm = lm[head.to_target_ids(torch.arange(head.cfg.draft_vocab_size, device=head.d2t.device)).to(lm.device)]
    elif settings.vocab == "data":
        lm = lm[torch.unique(data.tokens).to(lm.device)]
    lm = lm.to(device=device, dtype=ce_dtype)
    kept = set(held_out)
    trained = [i for i in range(data.sequences) if i not in kept] if kept else None
    if trained == []:
        raise MoedeskError("every prompt is held out of training (--holdout): lower it")
    sequences = data.sequences if trained is None else len(trained)
    total = settings.total_steps(sequences)
    per_epoch = math.ceil(sequences / settings.batch_size)
    figures: dict = {}
    started, first = time.perf_counter(), step
    head.train()
    order_of: tuple[int, list] = (-1, [])  # the epoch's batches, made once an epoch
    while step < total:
        epoch, index = divmod(step, per_epoch)
        if order_of[0] != epoch:
            order_of = (epoch, batch_order(data, settings, epoch, trained))
        batch = order_of[1][index]
        lr = learning_rate(settings, step, total)
        for group in opt.param_groups:
            group["lr"] = lr
        noise_gen = torch.Generator().manual_seed(settings.seed * 7_919 + step) if settings.noise else None
        loss, figures = batch_losses(head, lm, data, batch, settings, noise_gen, device, keep)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if settings.grad_clip:
            torch.nn.utils.clip_grad_norm_(head.parameters(), settings.grad_clip)
        opt.step()
        step += 1
        figures.update(step=step, lr=lr, epoch=epoch)
        if checkpoint is not None and (step % checkpoint_every == 0 or step == total):
            save_checkpoint(checkpoint, head, opt, settings, step)
            if on_checkpoint:
                on_checkpoint(step)
        if progress:
            progress("train", step, total, {**figures, "s": time.perf_counter() - started, "since": first})
    head.eval()
    if kept:
        figures["held_out_agree"] = _agreement(head, lm, data, sorted(kept), settings, device, keep)
        figures["train_agree"] = _agreement(head, lm, data, comparison_sample(trained, len(kept)), settings, device,
                                            keep)
    return figures


def comparison_sample(trained: list[int], n: int) -> list[int]:
    """n of the trained sequences, spread evenly over them (every k-th): measured beside the n held out, where the
    last batch's figure (16 sequences, the head just stepped on them) says little."""
    if n >= len(trained):
        return list(trained)
    return [trained[i * len(trained) // n] for i in range(n)]


# How far the held-out agreement may trail the trained one (mean over draft depths) and still count as the same.
SAME_AGREEMENT = 0.02
# ...and from how far behind it says the head memorises.
MEMORISES = 0.05


def holdout_advice(train_agree: list[float], held_out_agree: list[float]) -> str:
    """What the two agreements suggest for the next run: the head as good on prompts it never saw as on its own
    (within SAME_AGREEMENT) is under-trained, not short of data (on the demo, 5 epochs gave 0.64/0.61/0.59/0.58
    held out against 0.63/0.60/0.59/0.57 on a training batch; 10 epochs 0.67/0.64/0.62/0.62 held out and
    drafted 2.44 tokens a step on MT-bench against 2.32); well behind (MEMORISES) it memorises its prompts; "":
    in between, nothing to say."""
    gap = (sum(train_agree) - sum(held_out_agree)) / max(len(held_out_agree), 1)
    if gap <= SAME_AGREEMENT:
        return "as good on prompts it never saw as on its own: more steps (--epochs) may still help"
    if gap >= MEMORISES:
        return "better on its own prompts than on unseen ones: more prompts (--self-prompts) may help more than steps"
    return ""


def _agreement(head: EagleHead, lm: torch.Tensor, data: DraftData, sequences: list[int], settings: TrainSettings,
               device, keep: torch.Tensor | None) -> list[float]:
    """The head's top-1 agreement with the target by draft depth over `sequences`, every answer row counted once
    (batch_losses' figure, without a gradient)."""
    agreed = torch.zeros(settings.depths, dtype=torch.float64)
    rows = torch.zeros(settings.depths, dtype=torch.float64)
    with torch.no_grad():
        for at in range(0, len(sequences), settings.batch_size):
            figures = batch_losses(head, lm, data, sequences[at:at + settings.batch_size], settings, None, device,
                                   keep)[1]
            n = torch.tensor(figures["rows"], dtype=torch.float64)
            agreed += torch.tensor(figures["agree"], dtype=torch.float64) * n
            rows += n
    return (agreed / rows.clamp_min(1)).tolist()


def _param_names(head: EagleHead) -> list[str]:
    return [n for n, p in head.named_parameters() if p.requires_grad]


def save_checkpoint(path: Path, head: EagleHead, opt, settings: TrainSettings, step: int) -> None:
    from safetensors.torch import save_file

    tensors = {f"model.{n}": p.detach().float().cpu().contiguous() for n, p in head.named_parameters()}
    if head.cfg.version == 3:  # the draft vocabulary: a resumed run keeps it, whatever its data would choose now
        tensors["vocab.d2t"], tensors["vocab.t2d"] = head.d2t.cpu().contiguous(), head.t2d.cpu().contiguous()
    state = opt.state_dict()["state"]
    for i, name in enumerate(_param_names(head)):
        if i in state:
            tensors[f"adam.{name}.exp_avg"] = state[i]["exp_avg"].cpu().contiguous()
            tensors[f"adam.{name}.exp_avg_sq"] = state[i]["exp_avg_sq"].cpu().contiguous()
    meta = {"format": CHECKPOINT_FORMAT, "step": step, "adam_steps": {name: float(state[i]["step"])
            for i, name in enumerate(_param_names(head)) if i in state}, "settings": asdict(settings)}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"state": json.dumps(meta)}))
    # the same state for people and scripts to read (the checkpoint's own copy is the one resumed from)
    atomic_write(path.with_name("state.json"), lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))


def checkpoint_state(path: Path) -> dict:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return json.loads(meta["state"])
    except FileNotFoundError:
        raise MoedeskError(f"{path}: no checkpoint to resume from (run without --resume to start)") from None
    except (OSError, SafetensorError, KeyError, json.JSONDecodeError) as e:
        raise MoedeskError(f"{path}: not a train-draft checkpoint ({str(e).splitlines()[0] if str(e) else e})") from None


def checkpoint_draft_vocabulary(path: Path) -> torch.Tensor | None:
    """The draft vocabulary (target ids in draft-id order) an eagle3 checkpoint was trained with, or None."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        if "vocab.d2t" not in f.keys():
            return None
        d2t = f.get_tensor("vocab.d2t")
    return torch.arange(len(d2t)) + d2t


def load_checkpoint(path: Path, head: EagleHead, opt, settings: TrainSettings) -> int:
    from safetensors.torch import load_file

    meta = checkpoint_state(path)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise MoedeskError(f"{path}: checkpoint format {meta.get('format')}, expected {CHECKPOINT_FORMAT}")
    saved = meta.get("settings", {})
    for name, value in asdict(settings).items():
        if name in saved and saved[name] != value:
            raise MoedeskError(f"{path}: the checkpoint was trained with {name}={saved[name]!r}, this run asks for "
                               f"{value!r}; resume with the same settings")
    tensors = load_file(str(path))
    with torch.no_grad():
        for n, p in head.named_parameters():
            p.copy_(tensors[f"model.{n}"].to(p.device))
        for n in ("d2t", "t2d"):
            if f"vocab.{n}" in tensors:
                buffer = getattr(head, n)
                if tensors[f"vocab.{n}"].shape != buffer.shape:
                    raise MoedeskError(f"{path}: its draft vocabulary does not fit this head ({n} "
                                       f"{tuple(tensors[f'vocab.{n}'].shape)}, expected {tuple(buffer.shape)})")
                buffer.copy_(tensors[f"vocab.{n}"].to(buffer.device))
    state = {}
    for i, name in enumerate(_param_names(head)):
        if f"adam.{name}.exp_avg" in tensors:
            dev = head.fc.weight.device
            state[i] = {"step": torch.tensor(meta["adam_steps"][name]),
                        "exp_avg": tensors[f"adam.{name}.exp_avg"].to(dev),
                        "exp_avg_sq": tensors[f"adam.{name}.exp_avg_sq"].to(dev)}
    sd = opt.state_dict()
    sd["state"] = state
    opt.load_state_dict(sd)
    return int(meta["step"])


# --- writing the head ----------------------------------------------------------------------------------

def write_head(head: EagleHead, folder: Path, metadata: dict, dtype: torch.dtype = torch.bfloat16) -> Path:
    """config.json (with a "moedesk" entry: what the head was trained for) and model.safetensors, the layout
    engine.speculative.eagle.load_eagle_head reads; the embedding is left out (the target's is used)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(device="cpu", dtype=dtype).contiguous()
               for k, v in checkpoint_tensors(head, with_embedding=False).items()}
    hf = config_dict(head.cfg)
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    hf["moedesk"] = metadata
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "model.safetensors", lambda tmp: save_file(tensors, str(tmp)))
    atomic_write(folder / "config.json", lambda tmp: tmp.write_text(json.dumps(hf, indent=2) + "\n"))
    return folder


def head_metadata(engine, settings: TrainSettings, data: DraftData, prompts_path: str) -> dict:
    # target_layers: which of the model's layers an EAGLE-3 head reads, for `moedesk export-draft`
    meta = {"trained_by": "moedesk train-draft", "target": engine.name, "target_layers": engine.config.num_layers,
            "prompts": Path(prompts_path).name,
            "sequences": data.sequences, "answer_tokens": data.answer_tokens(),
            "settings": {k: v for k, v in asdict(settings).items()}}
    if engine.name == "demo":
        from moedesk.engine.load.demo import recipe

        r = recipe()
        meta.update(demo_recipe=r["name"], demo_recipe_version=r["version"])
    return meta


# --- the whole job ------------------------------------------------------------------------------------

def check_output_folder(out: Path) -> None:
    """MoedeskError (one line) unless files can be created in `out` (made if missing)."""
    problem = unwritable(out)
    if problem:
        raise MoedeskError(f"{out}: cannot write the draft head there ({problem})")
    if (out / "config.json").exists() and not (out / TRAINING_DIR).is_dir():
        raise MoedeskError(f"{out}: already holds a model that train-draft did not write; choose another --out")


def resume_settings(out) -> dict:
    """The settings `--resume` continues with: its last checkpoint's, or before the first checkpoint those its
    saved answers were made with. MoedeskError (one line) when `out` holds neither."""
    work = Path(out) / TRAINING_DIR
    checkpoint = work / "checkpoint.safetensors"
    # runs from before draft vocabularies drafted over the whole vocabulary: without the setting, they resume so
    old = {"draft_vocab": 0}
    if checkpoint.exists():
        return {**old, **checkpoint_state(checkpoint).get("settings", {})}
    head = AnswerLog.header(work / ANSWERS_FILE)
    if head is not None and isinstance(head.get("settings"), dict):
        return {**old, **head["settings"]}
    raise MoedeskError(f"{checkpoint}: no checkpoint or saved answers to resume from (run without --resume to start)")


def train_draft(engine, out, prompts_path=None, settings: TrainSettings | None = None, resume: bool = False,
                gen_batch_size: int = 32, checkpoint_every: int = 50, progress: Progress | None = None,
                log: Callable[[str], None] = lambda line: None, gen_refill: int = 1) -> dict:
    """Everything `moedesk train-draft` does after loading the model: data (reused from --out when made from the
    same model, prompts and settings), training (resumed on request), the head written to `out`. Returns a
    summary: steps, figures, seconds per phase."""
    settings = settings or TrainSettings()
    out = Path(out)
    check_output_folder(out)
    prompts_path = Path(prompts_path) if prompts_path else default_prompts_path()
    prompts = load_prompts(prompts_path)
    work = out / TRAINING_DIR
    checkpoint = work / "checkpoint.safetensors"
    if resume:
        saved = resume_settings(out)
        settings = TrainSettings(**{**asdict(settings), **{k: v for k, v in saved.items()
                                                            if k in {f.name for f in fields(TrainSettings)}}})
    if settings.head not in HEADS:
        raise MoedeskError(f"--head {settings.head!r}: expected one of {', '.join(HEADS)}")
    vocab_size = engine.config.vocab_size
    if settings.draft_vocab and settings.head != "eagle3":
        raise MoedeskError(f"--draft-vocab {settings.draft_vocab}: only an eagle3 head has a vocabulary of its own "
                           "(add --head eagle3)")
    if not 0 <= settings.draft_vocab <= vocab_size:
        raise MoedeskError(f"--draft-vocab {settings.draft_vocab}: must be from 1 to the model's vocabulary "
                           f"({vocab_size})")
    settings = replace(settings, ce_dtype=resolve_ce_dtype(settings.ce_dtype, engine.device))
    summary: dict = {"settings": asdict(settings)}
    if settings.self_prompts:
        written = self_written_prompts(engine, settings.self_prompts, settings.seed, work, gen_batch_size, prompts,
                                       progress, log)
        prompts = prompts + written
        summary["self_prompts"] = len(written)
    key = data_key(engine, prompts, settings.max_new_tokens, settings.samples, settings.sample_temperature,
                   settings.head)
    data_path = work / "data.safetensors"
    t0 = time.perf_counter()
    data = load_data(data_path, key) if data_path.exists() else None
    if data is not None:
        log(f"reusing the target's answers in {data_path} ({data.sequences} sequences)")
    else:
        answers = AnswerLog(work / ANSWERS_FILE, key, len(prompts) * settings.samples, settings.max_new_tokens,
                            asdict(settings), answers_key(engine, settings.max_new_tokens,
                                                          settings.sample_temperature, settings.head),
                            prompt_digests(prompts), settings.samples)
        if answers.load() or answers.dropped:
            log(f"continuing from the {len(answers.answers)} of {answers.requests} answers saved in {answers.path}"
                + (" (made for another prompt set: those of prompts still in it)" if answers.moved else "")
                + (f" ({answers.dropped} unreadable lines dropped)" if answers.dropped else ""))
        answers.open()
        try:
            data = generate_data(engine, prompts, settings.max_new_tokens, gen_batch_size, progress,
                                 samples=settings.samples, sample_temperature=settings.sample_temperature,
                                 saved=answers.answers, on_answer=answers.add, refill=gen_refill,
                                 head=settings.head)
        finally:
            answers.close()
        save_data(data, data_path, key)
    summary.update(data_s=round(time.perf_counter() - t0, 1), sequences=data.sequences,
                   answer_tokens=data.answer_tokens())
    draft_ids = None
    if settings.draft_vocab and settings.draft_vocab < vocab_size:
        # resumed from a checkpoint: its vocabulary, whatever the data now holds (answers made again on a GPU may
        # round differently); else the data's
        if resume and checkpoint.exists():
            draft_ids = checkpoint_draft_vocabulary(checkpoint)
        if draft_ids is None:
            draft_ids = draft_vocabulary(data, settings.draft_vocab, vocab_size)
        counts = predicted_token_counts(data, vocab_size)
        coverage = float(counts[draft_ids].sum()) / max(1, int(counts.sum()))
        summary["draft_vocab_coverage"] = round(coverage, 4)
        log(f"draft vocabulary: {len(draft_ids)} of the model's {vocab_size} tokens, {coverage:.1%} of the answer "
            f"tokens the head learns to predict")
    cfg = head_config(engine, settings.head, settings.draft_vocab, settings.head_width)
    head = init_head(engine, cfg, settings.init, settings.seed,
                     data.sequence(0)[0].tolist(), data, draft_ids)
    head.embed = engine.model.embed.weight.detach().to(head.fc.weight.device, torch.float32)
    lm_head = engine.model.lm_head.weight.detach()
    t1 = time.perf_counter()
    meta = head_metadata(engine, settings, data, str(prompts_path))
    if "draft_vocab_coverage" in summary:
        meta["draft_vocab_coverage"] = summary["draft_vocab_coverage"]

    def write_current(step):
        write_head(head, out, {**meta, "step": step})

    # resumed before the first checkpoint (in the answers or the features): training starts at step 0
    held_out = held_out_sequences(prompts, settings.samples, settings.holdout)
    if held_out:
        log(f"{len(held_out) // settings.samples} of the {len(prompts)} prompts held out of training")
    figures = train(head, lm_head, data, settings, checkpoint, resume=resume and checkpoint.exists(),
                    checkpoint_every=checkpoint_every,
                    progress=progress, on_checkpoint=write_current, held_out=held_out)
    summary.update(train_s=round(time.perf_counter() - t1, 1), figures=figures, held_out=len(held_out),
                   steps=settings.total_steps(data.sequences - len(held_out)))
    final = {"step": summary["steps"]}
    if "held_out_agree" in figures:
        final.update(held_out_prompts=len(held_out) // settings.samples,
                     held_out_agree=[round(a, 4) for a in figures["held_out_agree"]],
                     train_agree=[round(a, 4) for a in figures["train_agree"]])
    write_head(head, out, {**meta, **final})
    return summary
