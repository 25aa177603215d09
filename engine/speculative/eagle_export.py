"""An EAGLE-3 head folder for vLLM and SGLang: the same tensors, a config.json those engines' loaders read.

What differs from the folder `moedesk train-draft` writes is only config.json:
- which of the target's hidden states the head reads. Ours is the residual stream entering layers 2, L//2 and
  L-3 (`eagle3_feature_layers`). vLLM reads the ids at the top level, "eagle_aux_hidden_state_layer_ids", and
  captures the stream entering layer id (its default is ours). SGLang reads them inside "eagle_config" and
  captures the stream entering layer id + 1 (it names the layer whose output is taken), so its ids are ours - 1.
  vLLM prefers the top-level key, so one folder carries both.
- "bias" false (vLLM gives o_proj a bias with it, SGLang gives fc one; an EAGLE-3 head has neither),
  "tie_word_embeddings" false (SGLang would otherwise use the embedding as the LM head) and "model_type".
The token embedding is left to the target (both engines share it) unless the head folder has its own. A head
over the whole vocabulary drops d2t and t2d, its LM head's rows put in target order.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from moedesk.engine import json_read
from moedesk.engine.errors import MoedeskError
from moedesk.engine.speculative.eagle import (_config, _names, _read_tensors, config_dict, eagle3_feature_layers,
                                              whole_vocabulary_in_target_order)

ENGINES = ("vllm", "sglang")


def aux_layer_ids(target_layers: int, engine: str) -> list[int]:
    """The feature layers a moedesk EAGLE-3 head reads, in `engine`'s numbering."""
    ours = eagle3_feature_layers(target_layers)
    if engine == "vllm":
        return list(ours)
    if engine == "sglang":
        return [i - 1 for i in ours]
    raise ValueError(f"unknown engine {engine!r}")


def layer_count_problem(target_layers: int) -> str | None:
    """Why a model of `target_layers` layers cannot have its head served by those engines, or None. Both capture
    the states in layer order (so the head's order must be increasing) and SGLang's ids count from 0."""
    ours = eagle3_feature_layers(target_layers)
    if not 0 < ours[0] < ours[1] < ours[2]:
        return (f"a model of {target_layers} layers: the head reads layers {ours}, not three increasing ones, "
                "which vLLM and SGLang need (they concatenate the states in layer order)")
    return None


def export_config(source: dict, cfg, target_layers: int, engines=ENGINES) -> dict:
    """config.json for the exported head: ours, plus the keys vLLM's and SGLang's EAGLE-3 loaders read."""
    hf = config_dict(cfg)
    hf.update(model_type="llama", bias=False, tie_word_embeddings=False,
              # the length of those engines' rotary tables for the head; they draft within the target's context
              max_position_embeddings=_positive_int(source.get("max_position_embeddings")) or 32768)
    if "torch_dtype" in source:
        hf["torch_dtype"] = source["torch_dtype"]
    if "vllm" in engines:
        hf["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids(target_layers, "vllm")
    if "sglang" in engines:
        hf["eagle_config"] = {"use_aux_hidden_state": True,
                              "eagle_aux_hidden_state_layer_ids": aux_layer_ids(target_layers, "sglang")}
    ours = source.get("moedesk") if isinstance(source.get("moedesk"), dict) else {}
    hf["moedesk"] = {**ours, "target_layers": target_layers,
                     "feature_layers": list(eagle3_feature_layers(target_layers)), "exported_for": list(engines)}
    return hf


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _check_map(d2t: torch.Tensor, cfg, path) -> None:
    ids = torch.arange(len(d2t)) + d2t
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or len(ids.unique()) != len(ids)):
        raise MoedeskError(f"{path}: d2t maps a draft id outside the model's vocabulary or two to one token")


def export_eagle3(head_dir, out, engines=ENGINES, target_layers: int | None = None) -> Path:
    """Write `head_dir`'s EAGLE-3 head to `out` (config.json + model.safetensors) for `engines`. MoedeskError
    (one line) for a folder that is not an EAGLE-3 head, an EAGLE-1/2 head, or an `out` that holds files."""
    head_dir, out = Path(head_dir), Path(out)
    config_path = head_dir / "config.json"
    if not config_path.is_file():
        raise MoedeskError(f"{head_dir}: not a draft head folder (no config.json; `moedesk train-draft` makes one)")
    try:
        source = json_read.loads(config_path.read_text())
    except ValueError as e:
        raise MoedeskError(f"{config_path}: is not valid JSON ({e})") from None
    if not isinstance(source, dict):
        raise MoedeskError(f"{config_path}: is not a JSON object")
    tensors, weights_path = _read_tensors(head_dir)
    cfg = _config(source, tensors, weights_path)
    if cfg.version != 3:
        raise MoedeskError(f"{head_dir}: an EAGLE-1/2 head; export-draft writes EAGLE-3 heads only (vLLM's and "
                           "SGLang's EAGLE-1 support needs the target's LM head and another tensor layout: train one "
                           "with `moedesk train-draft --head eagle3`)")
    if cfg.qkv_bias:
        raise MoedeskError(f"{head_dir}: the head's q/k/v projections have biases, which SGLang's EAGLE-3 layer "
                           "lacks and vLLM ties to an o_proj bias")
    names = _names(cfg)
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise MoedeskError(f"{weights_path}: missing tensor {missing[0]}, not a complete EAGLE-3 head")
    keep = {k: tensors[k] for k in names}
    if "embed_tokens.weight" in tensors:
        keep["embed_tokens.weight"] = tensors["embed_tokens.weight"]
    elif cfg.hidden_size != cfg.target_hidden_size:
        raise MoedeskError(f"{head_dir}: the head is {cfg.hidden_size} wide and the model {cfg.target_hidden_size}, "
                           "and it has no embedding of its own; SGLang shares the model's only at equal widths")
    keep["d2t"], keep["t2d"] = keep["d2t"].to(torch.int64), keep["t2d"].to(torch.bool)
    _check_map(keep["d2t"], cfg, weights_path)
    if cfg.draft_vocab_size == cfg.vocab_size:
        # vLLM makes no parameter for d2t over the whole vocabulary and would refuse the tensor
        keep.update(whole_vocabulary_in_target_order(keep))
        del keep["d2t"], keep["t2d"]
    if target_layers is not None and _positive_int(target_layers) is None:
        raise MoedeskError(f"--target-layers {target_layers}: must be a positive layer count")
    if target_layers is None:
        recorded = source.get("moedesk")
        target_layers = recorded.get("target_layers") if isinstance(recorded, dict) else None
    if _positive_int(target_layers) is None:
        raise MoedeskError(f"{head_dir}: the model's layer count is not recorded in its config.json; give it with "
                           "--target-layers N (num_hidden_layers of the model the head was trained for)")
    problem = layer_count_problem(target_layers)
    if problem:
        raise MoedeskError(f"{head_dir}: {problem}")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise MoedeskError(f"--for {','.join(engines)}: one of vllm, sglang, both")
    if out.resolve() == head_dir.resolve():
        raise MoedeskError(f"--out {out}: the head's own folder; give another")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoedeskError(f"--out {out}: exists and is not an empty folder; nothing written")
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in keep.items()}, str(out / "model.safetensors"))
    hf = export_config(source, cfg, target_layers, engines)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out
