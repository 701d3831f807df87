"""LoRA on the learner (``learner.lora.rank > 0``): the model wrapped with ``peft``, only the adapters trained.

Why here and not in the engine: the engine stays one DeepSpeed engine over "a model whose trainable parameters are
some of its parameters"; this module is the only one that imports peft (and only when LoRA is on, so the default
run never does). The reference policy of a KL penalty is the same model with the adapters disabled
(`reference_context`): no frozen copy.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from arl.config import LoraConfig
from arl.utils.optional import import_optional
from arl.weights.adapter import target_problems, to_payload

__all__ = ["wrap_lora", "param_groups", "reference_context", "adapter_payload", "is_lora"]


def wrap_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """`model` wrapped in a peft ``PeftModel`` with the adapters of `lora`; only adapter (and ``modules_to_save``)
    parameters require grad. Refuses a target that names no module of the model (by its name), before peft's
    own, vaguer error."""
    problems = target_problems((n for n, _ in model.named_modules()), list(lora.target_modules),
                               list(lora.modules_to_save))
    if problems:
        raise ValueError("; ".join(problems))
    peft = import_optional("peft", "learner.lora.rank > 0 needs peft: pip install 'arl[lora]'")
    config = peft.LoraConfig(r=int(lora.rank), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                             target_modules=list(lora.target_modules),
                             modules_to_save=list(lora.modules_to_save) or None, bias="none", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def param_groups(model: torch.nn.Module, lr: float, lr_scale: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups of a wrapped `model`: the adapters at ``lr * lr_scale``, trained
    ``modules_to_save`` copies at ``lr``. Why two rates: an adapter's update is a low-rank product that starts from
    zero (B = 0), so it moves the weights far less per step than full fine-tuning does at the same rate; a module
    trained in full is full fine-tuning and keeps its rate."""
    adapters, full = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (adapters if ".lora_" in name else full).append(p)
    groups = [{"params": adapters, "lr": lr * lr_scale}]
    return groups + ([{"params": full, "lr": lr}] if full else [])


def is_lora(model: Any) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def reference_context(model: Any) -> ContextManager[Any]:
    """Forwards inside it run the base model (adapters and ``modules_to_save`` copies off): the initial policy."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


def adapter_payload(model: Any, state: Any = None) -> dict[str, torch.Tensor]:
    """The adapter payload (`arl.weights.adapter`) of peft `model`, from `state` (its full ``state_dict()``, e.g.
    gathered under ZeRO-3) or from the live parameters."""
    cfg = model.peft_config["default"]
    scaling = float(cfg.lora_alpha) / float(cfg.r)
    if state is None:
        state = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return to_payload(state, scaling)
