"""The adapter payload: what one policy version is when the learner trains LoRA adapters (``learner.lora.rank > 0``).

Why a payload mode and not a transport of its own: *what* travels (a full state dict or only the adapters) is
independent of *how* it travels (a file, a broadcast group). Every transport already moves "a dict of named
tensors"; the adapter payload is such a dict, so ``disk`` and ``broadcast`` (and a user's transport) carry it
unchanged, with the version/ack protocol of `arl.controller.weight_sync` untouched. Only the two ends know the
format: the learner's engine exports it (`to_payload`), an inference engine recognises it (`is_adapter`) and
applies it (the torch engine merges it into its own weight copies, keeping the base; SGLang loads it as a LoRA
adapter named per version, `write_peft_folder`).

The format, in the base model's parameter names (no peft prefixes), self-contained (no config needed to apply it):

- ``<module>.lora_A.weight``: ``[r, in]``;
- ``<module>.lora_B.weight``: ``[out, r]``, already multiplied by the scaling ``alpha / r``, so the merged weight is
  ``W = W_base + B @ A``;
- ``<param>``: the full tensor of each ``modules_to_save`` parameter (it replaces the base one).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Optional, Sequence

__all__ = ["LORA_A", "LORA_B", "is_adapter", "to_payload", "split_payload", "adapter_expected", "merged_weight",
           "target_problems", "write_peft_folder", "read_lora_config", "read_peft_folder", "merge_payload",
           "base_payload", "matches_module", "meta_model", "ADAPTER_NAME_PREFIX"]

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
ADAPTER_NAME_PREFIX = "arl-v"  # SGLang's adapter of version N is named f"arl-v{N}"
_PEFT_PREFIX = "base_model.model."


def is_adapter(names: Iterable[str]) -> bool:
    """Whether a dict with these names is an adapter payload (not a full state dict)."""
    return any(n.endswith(LORA_A) for n in names)


def to_payload(peft_state: Mapping[str, Any], scaling: float, adapter: str = "default") -> dict[str, Any]:
    """The payload from a peft model's ``state_dict()`` (the whole wrapped model, or only its trainable part):
    the adapters' A and B (B times `scaling`) and the ``modules_to_save`` copies, under the base model's names.
    The frozen base is left out: that is the point."""
    out: dict[str, Any] = {}
    a_key, b_key = f".lora_A.{adapter}.weight", f".lora_B.{adapter}.weight"
    save_key = f".modules_to_save.{adapter}."
    for k, v in peft_state.items():
        name = k[len(_PEFT_PREFIX):] if k.startswith(_PEFT_PREFIX) else k
        if name.endswith(a_key):
            out[name[: -len(a_key)] + LORA_A] = v
        elif name.endswith(b_key):
            out[name[: -len(b_key)] + LORA_B] = v * scaling if scaling != 1.0 else v
        elif save_key in name:
            out[name.replace(save_key, ".")] = v
    return out


def split_payload(payload: Mapping[str, Any]) -> tuple[dict[str, tuple[Any, Any]], dict[str, Any]]:
    """(``{base weight name: (A, B)}``, ``{name: full tensor}``) of a payload; raises on an A without its B."""
    pairs: dict[str, tuple[Any, Any]] = {}
    full: dict[str, Any] = {}
    for k, v in payload.items():
        if k.endswith(LORA_A):
            module = k[: -len(LORA_A)]
            if module + LORA_B not in payload:
                raise ValueError(f"adapter payload: {k} has no {module + LORA_B}")
            pairs[module + ".weight"] = (v, payload[module + LORA_B])
        elif k.endswith(LORA_B):
            if k[: -len(LORA_B)] + LORA_A not in payload:
                raise ValueError(f"adapter payload: {k} has no {k[: -len(LORA_B)] + LORA_A}")
        else:
            full[k] = v
    return pairs, full


def adapter_expected(base: Mapping[str, Any], shapes: Mapping[str, Sequence[int]]) -> tuple[dict[str, Any], list[str]]:
    """What a receiver of an adapter payload with these tensor `shapes` expects, as ``{name: meta tensor}`` (for
    `arl.weights.receiver.check_plan`), and the problems no shape check can see: an adapter on a weight the model
    does not have, A and B whose ranks differ or do not fit the weight. `base`: the model's state dict."""
    import torch

    expected: dict[str, Any] = {}
    problems: list[str] = []
    for k, shape in shapes.items():
        if k.endswith(LORA_A) or k.endswith(LORA_B):
            module = k[: -len(LORA_A if k.endswith(LORA_A) else LORA_B)]
            w = base.get(module + ".weight")
            b_shape = shapes.get(module + LORA_B) if k.endswith(LORA_A) else shape
            a_shape = shapes.get(module + LORA_A) if k.endswith(LORA_B) else shape
            if w is None or w.dim() != 2:
                problems.append(f"{k}: the model has no 2-d weight {module}.weight")
                continue
            if a_shape is None or b_shape is None or len(a_shape) != 2 or len(b_shape) != 2:
                problems.append(f"{k}: A and B of {module} must both come, 2-d")
                continue
            r = int(a_shape[0])
            want = (r, w.shape[1]) if k.endswith(LORA_A) else (w.shape[0], r)
            expected[k] = torch.empty(want, dtype=w.dtype, device="meta")
        elif k in base:
            expected[k] = base[k]
        else:
            problems.append(f"{k}: not a parameter of the model")
    return expected, problems


def merged_weight(base: Any, a: Any, b: Any) -> Any:
    """``base + b @ a`` in float32, in `base`'s dtype and device (a new tensor; `base` is kept to un-merge)."""
    delta = b.to(device=base.device, dtype=_float32()) @ a.to(device=base.device, dtype=_float32())
    return (base.to(_float32()) + delta).to(base.dtype)


def _float32() -> Any:
    import torch

    return torch.float32


def matches_module(name: str, key: str) -> bool:
    """Whether peft's `target_modules` / `modules_to_save` entry `key` names module `name`: the name itself or a
    dotted suffix of it."""
    return name == key or name.endswith("." + key)


def meta_model(source: Any) -> Any:
    """The causal LM of a model folder, or of a transformers config, built on the meta device: its module names
    and shapes without reading or allocating a weight."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source) if isinstance(source, (str, os.PathLike)) else source
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def target_problems(module_names: Iterable[str], target_modules: Sequence[str],
                    modules_to_save: Sequence[str] = ()) -> list[str]:
    """Why ``learner.lora`` does not fit a model whose modules are `module_names` (``named_modules()`` names):
    each target or module to save that matches no module, by name (peft matches a name or a dotted suffix)."""
    names = [n for n in module_names if n]
    out = []
    for key, wanted in (("target_modules", target_modules), ("modules_to_save", modules_to_save)):
        for t in wanted:
            if not any(matches_module(n, t) for n in names):
                leaves = sorted({n.rsplit(".", 1)[-1] for n in names if not n.rsplit(".", 1)[-1].isdigit()})
                out.append(f"learner.lora.{key}: no module of the model is named {t!r} (its module names: "
                           f"{', '.join(leaves[:20])}{' ...' if len(leaves) > 20 else ''})")
    return out


def write_peft_folder(payload: Mapping[str, Any], out_dir: str, *, base_model: str = "",
                      metadata: Optional[Mapping[str, str]] = None) -> str:
    """A ``peft`` adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) holding `payload`:
    ``PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter`` read it. B is already scaled, so the folder
    says ``lora_alpha = r`` (scaling 1). Written into `out_dir` (created); returns it."""
    from safetensors.torch import save_file

    pairs, full = split_payload(payload)
    if not pairs:
        raise ValueError("write_peft_folder: the payload holds no adapter")
    rank = int(next(iter(pairs.values()))[0].shape[0])
    targets = sorted({name[: -len(".weight")].rsplit(".", 1)[-1] for name in pairs})
    to_save = sorted({name.rsplit(".", 2)[-2] for name in full})
    tensors = {}
    for name, (a, b) in pairs.items():
        module = name[: -len(".weight")]
        tensors[f"{_PEFT_PREFIX}{module}.lora_A.weight"] = a.detach().to("cpu").contiguous()
        tensors[f"{_PEFT_PREFIX}{module}.lora_B.weight"] = b.detach().to("cpu").contiguous()
    for name, t in full.items():
        tensors[_PEFT_PREFIX + name] = t.detach().to("cpu").contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
              "target_modules": targets, "modules_to_save": to_save or None, "bias": "none",
              "base_model_name_or_path": base_model, "fan_in_fan_out": False, "inference_mode": True,
              "use_rslora": False, "init_lora_weights": True}
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"),
              metadata={"format": "pt", **dict(metadata or {})})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def read_lora_config(folder: str) -> dict[str, Any]:
    """The ``adapter_config.json`` of a plain peft LoRA folder, the kind `read_peft_folder` reads (that file and
    ``adapter_model.safetensors``; peft_type LORA with an integer r; no rslora, rank or alpha patterns). ValueError
    naming what it is not."""
    config_file = os.path.join(folder, "adapter_config.json")
    if not folder or not os.path.isfile(config_file) or not os.path.isfile(
            os.path.join(folder, "adapter_model.safetensors")):
        raise ValueError(f"{folder!r} is not a peft LoRA folder (adapter_config.json and adapter_model.safetensors)")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file} is unreadable: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} is not a JSON object")
    r = config.get("r")
    if str(config.get("peft_type", "LORA")).upper() != "LORA" or isinstance(r, bool) or not isinstance(r, int):
        raise ValueError(f"{folder!r} is not a LoRA adapter (peft_type LORA with an integer r)")
    if config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{folder}: only plain LoRA adapters (no rslora, rank or alpha patterns) are read")
    return config


def base_payload(model_dir: str, target_modules: Sequence[str]) -> dict[str, Any]:
    """A payload that changes nothing: rank-1 zero A and B on every linear layer `target_modules` names (peft's
    suffix match) of the model in `model_dir`, shaped from its config (built on the meta device, no weights read).
    Served as a named policy it is the base model itself; in a LoRA run, the run's policy as it started."""
    import torch

    out: dict[str, Any] = {}
    for name, module in meta_model(model_dir).named_modules():
        if isinstance(module, torch.nn.Linear) and any(matches_module(name, t) for t in target_modules):
            out[name + LORA_A] = torch.zeros(1, module.in_features)
            out[name + LORA_B] = torch.zeros(module.out_features, 1)
    if not out:
        raise ValueError(f"no linear layer of {model_dir} is named by {list(target_modules)}")
    return out


def read_peft_folder(folder: str) -> dict[str, Any]:
    """The payload of a peft LoRA folder (ours, or any with ``adapter_config.json`` + ``adapter_model.safetensors``:
    its B is scaled by its ``lora_alpha / r`` here). Raises on what is not a plain LoRA folder (`read_lora_config`)."""
    from safetensors.torch import load_file

    config = read_lora_config(folder)
    scaling = float(config.get("lora_alpha", config["r"])) / float(config["r"])
    state = load_file(os.path.join(folder, "adapter_model.safetensors"))
    out: dict[str, Any] = {}
    for k, v in state.items():  # saved peft names have no adapter name: lora_A.weight, lm_head.weight
        name = k[len(_PEFT_PREFIX):] if k.startswith(_PEFT_PREFIX) else k
        out[name] = v * scaling if name.endswith(LORA_B) and scaling != 1.0 else v
    return out


def merge_payload(base: Mapping[str, Any], payload: Mapping[str, Any]) -> dict[str, Any]:
    """A full state dict: `base` (the base model's) with the payload merged in (``W + B @ A``; the
    ``modules_to_save`` tensors replace theirs). Raises on an adapter of a weight `base` does not have."""
    out = dict(base)
    adapters, full = split_payload(payload)
    for name, (a, b) in adapters.items():
        if name not in out:
            raise ValueError(f"adapter for {name}, which the base model does not have")
        out[name] = merged_weight(out[name], a, b)
    for name, t in full.items():
        out[name] = t
    return out
