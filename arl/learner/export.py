"""The run's product: ``<run>/final/``, a ``save_pretrained`` folder that transformers and SGLang load as it is.

`export_final(weights, model_dir, out_dir)` writes the trained weights with the base model's config, the base
model's tokenizer files (so the chat template and special tokens are the ones the run used), and a
``generation_config.json`` carrying the run's sampling settings and every stop token the run stopped on. The
weights come from the learner's last exported safetensors file (what the inference workers ran), a state dict, or
an engine with ``full_state_dict()``; the first needs no collective, which is why the learner worker passes the file
it just exported: only rank 0 runs the learner worker, so only rank 0 writes. The folder is assembled in a sibling
temporary directory and renamed into place, so a crash leaves either the old folder or the new one.

``arl_export.json`` in the folder records the policy version and where the weights came from
(`scripts/evaluate.py` prints that version).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
from typing import Any, Mapping, Optional, Union

import torch

from arl.learner.checkpoint import replacing_dir
from arl.models.tiny import stop_token_ids
from arl.weights.adapter import meta_model

__all__ = ["export_final", "export_final_lora", "load_weights", "tied_aliases", "TOKENIZER_FILES", "EXPORT_INFO_FILE"]

EXPORT_INFO_FILE = "arl_export.json"
# The files of a HF tokenizer (fast, slow or tiktoken) and its chat template(s): copied from the base model as is.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "*.tiktoken", "chat_template.json",
                   "chat_template.jinja", "additional_chat_templates/*")

Weights = Union[str, Mapping[str, torch.Tensor], Any]


def load_weights(weights: Weights) -> Optional[dict[str, torch.Tensor]]:
    """A full state dict from a safetensors file (or a folder of them), a state dict, or an engine's
    ``full_state_dict()`` (collective under ZeRO-3: returns None on ranks other than 0)."""
    if isinstance(weights, (str, os.PathLike)):
        from safetensors.torch import load_file

        path = os.fspath(weights)
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors weights at {path!r}")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(f))
        return sd
    if isinstance(weights, Mapping):
        return dict(weights)
    if hasattr(weights, "full_state_dict"):
        return weights.full_state_dict()
    raise TypeError(f"weights must be a safetensors path, a state dict or an engine, got {type(weights).__name__}")


def _file_version(path: str) -> Optional[int]:
    """The policy version the learner stamped into a weights file's metadata, if any."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        v = (f.metadata() or {}).get("version")
    return int(v) if v is not None and str(v).isdigit() else None


def _generation_config(model_dir: str, gen: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The base model's generation config, with the run's sampling settings and all its stop tokens."""
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            out = dict(json.load(f))
    except (OSError, ValueError):
        out = {}
    stops = stop_token_ids(model_dir)
    if stops:
        out["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(model_dir, "config.json")) as f:
            pad = json.load(f).get("pad_token_id")
        if pad is not None and "pad_token_id" not in out:
            out["pad_token_id"] = pad
    if gen:
        out["do_sample"] = True
        out["temperature"] = float(gen.get("temperature", 1.0))
        top_p, top_k = float(gen.get("top_p", 1.0)), int(gen.get("top_k", 0))
        out.pop("top_p", None)
        out.pop("top_k", None)
        if top_p < 1.0:
            out["top_p"] = top_p
        if top_k > 0:  # ARL's 0 means off; transformers' off is None
            out["top_k"] = top_k
        if gen.get("max_new_tokens"):
            out["max_new_tokens"] = int(gen["max_new_tokens"])
        if int(gen.get("min_new_tokens", 0) or 0) > 0:
            out["min_new_tokens"] = int(gen["min_new_tokens"])
    return out


def _tied_apart(model: Any, sd: dict[str, torch.Tensor]) -> bool:
    """Whether `sd` holds different tensors under names `model` ties: a LoRA run's merge, where peft trained its
    own copy of one side (``modules_to_save=[lm_head]``) and the other kept the base."""
    for group in _tie_groups(model):
        present = [n for n in group if n in sd]
        if any(not torch.equal(sd[n], sd[present[0]]) for n in present[1:]):
            return True
    return False


def _untie(model: Any, sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Drop the copies of tied parameters (lm_head = embeddings) from `sd`: the learner's state dict holds each as
    its own tensor, the folder keeps one. Returns the dict and the names dropped or not needed; refuses tied
    copies that differ."""
    sd, tied = dict(sd), set()
    for group in _tie_groups(model):
        keep = next((n for n in group if n in sd), group[0])
        for other in group:
            if other == keep:
                continue
            tied.add(other)
            if other in sd:
                if not torch.equal(sd[other], sd[keep]):
                    raise ValueError(f"tied parameters {keep} and {other} differ in the weights")
                del sd[other]
    return sd, tied


def tied_aliases(model_dir: str) -> set[str]:
    """Names of the model of `model_dir` that are tied copies of another parameter (lm_head.weight with tied
    embeddings): a state dict sent to inference leaves them out (SGLang wants each tensor once; the torch engine's
    model shares the parameter)."""
    return {n for group in _tie_groups(meta_model(model_dir)) for n in group[1:]}


def _tie_groups(model: Any) -> list[list[str]]:
    """The parameter names of `model` per parameter object, in its order: a tied pair is one group of two."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return list(names.values())


def _copy_tokenizer(model_dir: str, out: str) -> list[str]:
    copied = []
    for root, _dirs, files in os.walk(model_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), model_dir)
            if any(fnmatch.fnmatch(rel, pat) for pat in TOKENIZER_FILES):
                os.makedirs(os.path.dirname(os.path.join(out, rel)) or out, exist_ok=True)
                shutil.copy2(os.path.join(model_dir, rel), os.path.join(out, rel))
                copied.append(rel)
    if not any(c.startswith("tokenizer") for c in copied):
        raise FileNotFoundError(f"no tokenizer files in {model_dir!r}")
    return copied


def export_final(weights: Weights, model_dir: str, out_dir: str, *, gen: Optional[Mapping[str, Any]] = None,
                 version: Optional[int] = None, lora_merge: bool = False) -> Optional[str]:
    """Write `out_dir` as a ``save_pretrained`` folder: the model of `model_dir` (config, architecture) with
    `weights`, the tokenizer files of `model_dir`, and ``generation_config.json`` from `gen` (the run's ``gen.*``
    settings: temperature, top_p, top_k, max_new_tokens). `version` (default: the one in a weights file's
    metadata) goes into ``arl_export.json``. Returns `out_dir`, or None on a rank that holds no
    weights (see `load_weights`). Tied parameters whose tensors differ are refused, except with `lora_merge`
    (`weights` is a base with a LoRA payload merged in, `merge_payload`): there peft trained its own copy of one
    side (``modules_to_save=[lm_head]``) and the other kept the base, so the folder is written untied."""
    from transformers import AutoConfig

    sd = load_weights(weights)
    if sd is None:
        return None
    if version is None and isinstance(weights, (str, os.PathLike)) and os.path.isfile(weights):
        version = _file_version(os.fspath(weights))
    config = AutoConfig.from_pretrained(model_dir)
    float_dtypes = {v.dtype for v in sd.values() if v.is_floating_point()}
    if len(float_dtypes) == 1:  # the dtype the weights are in (bf16 training exports bf16)
        config.dtype = next(iter(float_dtypes))
    model = meta_model(config)
    if lora_merge and _tied_apart(model, sd):
        for c in {id(c): c for c in (config, config.get_text_config(decoder=True))}.values():
            c.tie_word_embeddings = False
        model = meta_model(config)
    sd, tied = _untie(model, sd)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(sd) - tied, set(sd) - expected
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model of {model_dir!r}: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    with replacing_dir(out_dir, ".tmp-final-") as tmp:
        model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        _copy_tokenizer(model_dir, tmp)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(_generation_config(model_dir, gen), f, indent=2)
        info = {"version": version, "base_model": os.path.abspath(model_dir),
                "weights": os.path.abspath(weights) if isinstance(weights, (str, os.PathLike)) else None}
        with open(os.path.join(tmp, EXPORT_INFO_FILE), "w") as f:
            json.dump(info, f, indent=2)
    return os.path.abspath(out_dir)


def base_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    """The weights of the model folder `model_dir` (every ``*.safetensors`` in it)."""
    sd = load_weights(model_dir)
    assert sd is not None
    return sd


def export_final_lora(weights: Weights, model_dir: str, out_dir: str, *, gen: Optional[Mapping[str, Any]] = None,
                      version: Optional[int] = None, merge: bool = False) -> Optional[str]:
    """LoRA's ``final/``: `weights` (an adapter payload, `arl.weights.adapter`: a file or a dict) as a ``peft``
    folder (``PeftModel.from_pretrained(base, out_dir)`` loads it) with the tokenizer and generation config of
    `model_dir`; with `merge`, also ``out_dir/merged/``, the base with the adapter merged in (a ``save_pretrained``
    model, see `export_final`). Returns `out_dir`, or None on a rank that holds no weights."""
    from arl.weights.adapter import merge_payload, write_peft_folder

    payload = load_weights(weights)
    if payload is None:
        return None
    if version is None and isinstance(weights, (str, os.PathLike)) and os.path.isfile(weights):
        version = _file_version(os.fspath(weights))
    with replacing_dir(out_dir, ".tmp-final-") as tmp:
        write_peft_folder(payload, tmp, base_model=os.path.abspath(model_dir),
                          metadata={"version": str(version)})
        _copy_tokenizer(model_dir, tmp)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(_generation_config(model_dir, gen), f, indent=2)
        if merge:
            export_final(merge_payload(base_state_dict(model_dir), payload), model_dir, os.path.join(tmp, "merged"),
                         gen=gen, version=version, lora_merge=True)
        info = {"version": version, "base_model": os.path.abspath(model_dir), "payload": "lora",
                "merged": "merged" if merge else None,
                "weights": os.path.abspath(weights) if isinstance(weights, (str, os.PathLike)) else None}
        with open(os.path.join(tmp, EXPORT_INFO_FILE), "w") as f:
            json.dump(info, f, indent=2)
    return os.path.abspath(out_dir)
