"""The short names `moedesk pull` knows: a few popular Mixture-of-Experts models, as Ollama users name them.

A name is `NAME` or `NAME:TAG`. NAME is a key of CATALOGUE; TAG is a GGUF quantisation as the GGUF repo's
file names write it, in any case (`q4_k_m`, `q8_0`, `mxfp4`), or `safetensors` for the original checkpoint.
Without a tag the entry's default quantisation is taken, as Ollama's default tags are 4-bit.
Anything with a slash is a Hugging Face repo id instead (`OWNER/NAME[:TAG]`), pulled as `moedesk download`
would. Which files a quantisation is (one file, or the parts of a split one) is read from the repo's listing
when pulling (app.download.group_choices), so the table holds only repo ids and tags.

Once pulled, the same name is a `--model` (`local_model`: the files in the Hugging Face cache), as `ollama run`
takes what `ollama pull` fetched.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from moedesk.engine.errors import MoedeskError


@dataclass(frozen=True)
class CatalogueEntry:
    gguf_repo: str  # a repo of GGUF quantisations of the model
    default_tag: str  # the quantisation pulled when no tag is given
    safetensors_repo: str  # the original checkpoint: `NAME:safetensors`
    about: str


CATALOGUE: dict[str, CatalogueEntry] = {
    "qwen3:30b-a3b": CatalogueEntry("unsloth/Qwen3-30B-A3B-GGUF", "Q4_K_M", "Qwen/Qwen3-30B-A3B",
                                    "Qwen3 30B, 128 experts, 3B active"),
    "gpt-oss:20b": CatalogueEntry("ggml-org/gpt-oss-20b-GGUF", "MXFP4", "openai/gpt-oss-20b",
                                  "OpenAI gpt-oss 20B, 32 experts, MXFP4 as released"),
    "gpt-oss:120b": CatalogueEntry("ggml-org/gpt-oss-120b-GGUF", "MXFP4", "openai/gpt-oss-120b",
                                   "OpenAI gpt-oss 120B, 128 experts, MXFP4 as released"),
    "glm-4.5-air": CatalogueEntry("unsloth/GLM-4.5-Air-GGUF", "Q4_K_M", "zai-org/GLM-4.5-Air",
                                  "GLM-4.5-Air 106B, 128 experts, 12B active"),
    # Qwen3.5 and 3.6 as Ollama names them; their checkpoints are multimodal, moedesk runs the text model
    "qwen3.5:35b": CatalogueEntry("unsloth/Qwen3.5-35B-A3B-GGUF", "Q4_K_M", "Qwen/Qwen3.5-35B-A3B",
                                  "Qwen3.5 35B, 256 experts and a shared one, 3B active; text only"),
    "qwen3.6:35b": CatalogueEntry("ggml-org/Qwen3.6-35B-A3B-GGUF", "Q4_K_M", "Qwen/Qwen3.6-35B-A3B",
                                  "Qwen3.6 35B, 3B active; text only"),
    "glm-4.7-flash": CatalogueEntry("unsloth/GLM-4.7-Flash-GGUF", "Q4_K_M", "zai-org/GLM-4.7-Flash",
                                    "GLM-4.7-Flash, 64 experts, latent attention (MLA)"),
    "mixtral:8x7b": CatalogueEntry("TheBloke/Mixtral-8x7B-Instruct-v0.1-GGUF", "Q4_K_M",
                                   "mistralai/Mixtral-8x7B-Instruct-v0.1", "Mixtral 8x7B Instruct, 8 experts, top-2"),
}

# Other names people type for the same models: Ollama's own tags, and the names with the active parameters spelt out.
ALIASES = {"qwen3:30b": "qwen3:30b-a3b", "qwen3.5:35b-a3b": "qwen3.5:35b", "qwen3.6:35b-a3b": "qwen3.6:35b"}

SAFETENSORS = "safetensors"


@dataclass(frozen=True)
class PullTarget:
    repo_id: str
    tag: str | None  # a GGUF quantisation, "safetensors", or None: the repo's default choice (as `download`)


def resolve(name: str, catalogue: dict[str, CatalogueEntry] | None = None) -> PullTarget:
    """What `moedesk pull NAME` downloads. Raises MoedeskError (one line) for a short name not in the catalogue."""
    catalogue = CATALOGUE if catalogue is None else catalogue
    name = name.strip()
    if "/" in name:
        repo, _, tag = name.partition(":")
        return PullTarget(repo, tag or None)
    lowered = name.lower()
    if ALIASES.get(lowered, lowered) in catalogue:
        entry, tag = catalogue[ALIASES.get(lowered, lowered)], None
    else:
        base, _, tag = lowered.rpartition(":")
        entry = catalogue.get(ALIASES.get(base, base)) if base else None
        if entry is None or not tag:
            raise MoedeskError(f"pull {name}: not a model moedesk knows by name (known: {', '.join(catalogue)}); "
                               "or give a Hugging Face repo id, OWNER/NAME")
    tag = tag or entry.default_tag
    if tag == SAFETENSORS:
        return PullTarget(entry.safetensors_repo, SAFETENSORS)
    return PullTarget(entry.gguf_repo, tag)


def pick_choice(listing, tag: str | None):
    """The DownloadChoice a pull's tag names in the repo's listing. Raises MoedeskError (one line) when there
    is none, naming the tags there are."""
    if tag is None:
        choice = listing.default_choice()
    elif tag.lower() == SAFETENSORS:
        choice = next((c for c in listing.choices if c.kind == "safetensors"), None)
    else:
        choice = next((c for c in listing.choices if c.kind == "gguf" and c.name.lower() == tag.lower()), None)
    if choice is None:
        tags = ", ".join(c.name.lower() for c in listing.choices) or "none: no .safetensors or .gguf weights"
        asked = f":{tag}" if tag else " (several quantisations: add one as a tag)"
        raise MoedeskError(f"pull {listing.repo_id}{asked}: no such choice; its tags: {tags}")
    return choice


def short_name(repo_id: str, quant: str) -> str | None:
    """The short name that pulls this quantisation of this GGUF repo (`qwen3.5:35b`, `qwen3.5:35b:q8_0`), None for a
    repo the catalogue does not name: what `moedesk list` shows, and `--model` takes back (`local_model`)."""
    for name, entry in CATALOGUE.items():
        if entry.gguf_repo.lower() == repo_id.lower():
            return name if quant.lower() == entry.default_tag.lower() else f"{name}:{quant.lower()}"
    return None


def local_model(name: str) -> str | None:
    """What `--model NAME` loads when NAME is a short name pulled before (as `ollama run` takes what `ollama pull`
    fetched): its quantisation's .gguf in the Hugging Face cache (a split one's first part), or for `:safetensors`
    its repo id. None when NAME is no short name, or is a path on disk. Raises MoedeskError (one line) for a short
    name whose files are not here yet."""
    if "/" in name or os.path.exists(os.path.expanduser(name)):
        return None
    try:
        target = resolve(name)
    except MoedeskError:
        return None
    from moedesk.app.download import gguf_quant
    from moedesk.engine.selection import model_path

    folder = model_path(target.repo_id)
    if folder is not None and target.tag == SAFETENSORS:
        if any(folder.glob("*.safetensors")):
            return target.repo_id
    elif folder is not None:
        parts = sorted(p for p in folder.rglob("*.gguf")
                       if not p.name.lower().startswith("mmproj") and gguf_quant(p.name).lower() == target.tag.lower())
        if parts:
            return str(parts[0])
    raise MoedeskError(f"{name} is not on this computer yet: `moedesk pull {name}` downloads it")
