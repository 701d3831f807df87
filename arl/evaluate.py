"""Evaluate a model folder (a run's ``final/``, any HF folder) or a learner checkpoint the way a run evaluates.

A LoRA run's ``final/`` is a peft adapter folder: it is merged into its base model (``base_model_name_or_path``,
else the run's ``model.path``) in a temporary folder first; its ``final/merged/`` is a plain model folder.

Same code as the run's evaluations: the inference engine comes from `build_engine` with the run's
``inference.*`` settings, served by an `InferenceWorker` over the same sockets, reached through an
`InferenceClient`, and `RolloutWorker.evaluate` runs the experiment's greedy evaluation agent (`agent_parts`) on
its held-out split (``eval.max_prompts`` rows, ``eval.concurrency`` at once, the token ledger if
``rollout.verify_token_ledger``). Everything lives in this one process and event loop; no controller, learner or
training rollouts.

Which config: the run's own ``config.yaml`` when the path lies in a run directory (``<run>/final``,
``<run>/checkpoints[/v<N>]``, or ``<run>`` itself, which means its ``final/``), with ``key=value`` overrides on top;
``experiment=NAME`` starts from that experiment's defaults instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import tempfile
from typing import Any, Optional, Sequence

from arl.config import ConfigError, ExperimentConfig, import_user_modules, parse_overrides, resolve_threads, \
    split_experiment
from arl.controller.reporting import format_result  # the controller's eval line, printed here too
from arl.transport.messages import ControlMessage

logger = logging.getLogger("arl.evaluate")

__all__ = ["resolve_target", "load_eval_config", "checkpoint_state_dict", "evaluate_model", "format_result"]


@dataclasses.dataclass
class Target:
    """What the command line pointed at: a model folder or a checkpoint, and the run it belongs to (if any)."""

    kind: str  # "model" or "checkpoint"
    path: str  # the HF folder, or the checkpoint tag directory
    run_dir: Optional[str]


def _is_run_dir(d: str) -> bool:
    return os.path.isfile(os.path.join(d, "config.yaml"))


def resolve_target(path: str) -> Target:
    """Tell a model folder from a checkpoint (tag directory, or a checkpoints folder with ``latest``) or a run
    directory (its ``final/``)."""
    from arl.learner.checkpoint import CHECKPOINT_SUBDIR, latest_checkpoint

    p = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(p):
        raise FileNotFoundError(f"{path!r} is not a directory")
    if os.path.isfile(os.path.join(p, "config.json")):  # <run>/final, or a LoRA run's <run>/final/merged
        parent = os.path.dirname(p)
        run = next((d for d in (parent, os.path.dirname(parent)) if _is_run_dir(d)), None)
        return Target("model", p, run)
    if os.path.isfile(os.path.join(p, "adapter_config.json")):  # a LoRA run's final/ (a peft folder)
        parent = os.path.dirname(p)
        return Target("adapter", p, parent if _is_run_dir(parent) else None)
    if _is_run_dir(p) and os.path.isdir(os.path.join(p, "final")):
        return Target(resolve_target(os.path.join(p, "final")).kind, os.path.join(p, "final"), p)
    tag = latest_checkpoint(p) or latest_checkpoint(os.path.join(p, CHECKPOINT_SUBDIR))
    if tag is None and any(f.endswith("model_states.pt") for f in os.listdir(p)):
        tag = p
    if tag is not None:
        run = os.path.dirname(os.path.dirname(tag))
        return Target("checkpoint", tag, run if _is_run_dir(run) else None)
    raise FileNotFoundError(f"{path!r} is neither a model folder (config.json), a LoRA adapter folder "
                            "(adapter_config.json), a run directory with final/, nor a "
                            "learner checkpoint")


def load_eval_config(target: Target, argv: Sequence[str]) -> ExperimentConfig:
    """The run's config (or ``experiment=NAME``'s defaults) with the ``key=value`` overrides of `argv`."""
    name, rest = split_experiment(argv)
    if name is None and target.run_dir:
        from arl.launch.role import load_run_config

        base = load_run_config(os.path.join(target.run_dir, "config.yaml"))
        cfg = parse_overrides(type(base), rest, base=base)
    else:
        from arl.cli import load_config

        cfg = load_config(argv)
    import_user_modules(list(cfg.imports))
    if target.kind == "checkpoint" and not cfg.model.path:
        raise ConfigError("a checkpoint outside a run directory needs model.path=<the base model folder> (its "
                          "config and tokenizer)")
    return cfg


def checkpoint_state_dict(tag_dir: str) -> dict:
    """The model weights of a learner checkpoint (DeepSpeed tag directory): the module state of ZeRO 0-2 (in the
    training dtype, as the learner exports it), or the consolidated fp32 weights of ZeRO-3."""
    import torch

    states = sorted(f for f in os.listdir(tag_dir) if f.endswith("model_states.pt"))
    if not states:
        raise FileNotFoundError(f"no DeepSpeed model states in {tag_dir!r}")
    # the checkpoint holds RNG states and the client state beside the tensors: not loadable with weights_only
    module = torch.load(os.path.join(tag_dir, states[0]), map_location="cpu", weights_only=False).get("module") or {}
    if module and all(v.numel() > 0 for v in module.values()):
        return {k: v.detach().clone() for k, v in module.items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # ZeRO-3: partitioned

    return get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(tag_dir), tag=os.path.basename(tag_dir))


async def _no_controller(msg: ControlMessage) -> None:
    """Control messages have no receiver here (they are typed all the same)."""


async def _no_learner(group: Any) -> None:
    """Trajectory pushes have no receiver here."""


async def evaluate_model(cfg: ExperimentConfig, model_dir: str, version: int = -1) -> dict:
    """`RolloutWorker.evaluate` of the model in `model_dir` under `cfg` (see the module docstring)."""
    from arl.inference.factory import build_engine
    from arl.inference.worker import InferenceWorker
    from arl.rollout.entry import agent_parts, inference_client, rollout_worker
    from arl.rollout.worker import PromptStream
    from arl.transport import sockets

    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model_dir))
    ic = cfg.inference
    parts = agent_parts(cfg)
    scratch = tempfile.mkdtemp(prefix="arl-eval-")  # the sglang backend writes its server log here
    os.makedirs(os.path.join(scratch, "logs"), exist_ok=True)
    engine = build_engine(model_dir, ic, seed=cfg.seed, index=0, run_dir=scratch)  # server 0's seed, as in a run
    router = sockets.Router(max_bytes=cfg.max_message_bytes)
    address = sockets.bind_random(router, "127.0.0.1")
    server = InferenceWorker(index=0, engine=engine, router=router, send_control=_no_controller)
    serving = asyncio.create_task(server.serve())
    dealer = sockets.Dealer(max_bytes=cfg.max_message_bytes).connect(address)
    client = inference_client(cfg, [dealer])
    prompts = PromptStream(parts.train_rows or [{}], seed=cfg.seed)
    worker = rollout_worker(cfg, parts, client, index=0, prompts=prompts, capacity=1, send_control=_no_controller,
                            push_group=_no_learner)
    try:
        result = await worker.evaluate(version, cfg.eval.max_prompts)
        result["ledger_checked"] = int(worker.stats["ledger_checked"])
        result["ledger_failures"] = int(worker.stats["ledger_failures"])
        return result
    finally:
        await worker.close()
        await client.close()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await engine.close()
        dealer.close()
        router.close()


def run(path: str, argv: Sequence[str]) -> dict:
    """Resolve `path`, build the config, export a checkpoint to a temporary model folder if need be, evaluate."""
    import json
    import shutil

    import torch

    from arl.learner.export import EXPORT_INFO_FILE, export_final
    from arl.transport.loop import run as run_loop

    target = resolve_target(path)
    cfg = load_eval_config(target, argv)
    torch.set_num_threads(resolve_threads(cfg, "inference"))  # the run's inference threads: same arithmetic
    tmp: Optional[str] = None
    version = -1
    try:
        if target.kind == "checkpoint":
            tmp = tempfile.mkdtemp(prefix="arl-eval-model-")
            model_dir = export_final(checkpoint_state_dict(target.path), cfg.model.path, os.path.join(tmp, "model"),
                                     gen=dataclasses.asdict(cfg.gen))
            assert model_dir is not None
            name = os.path.basename(target.path)
            version = int(name[1:]) if name[:1] == "v" and name[1:].isdigit() else -1
        elif target.kind == "adapter":  # merged into its base model in a temporary folder
            from arl.learner.export import base_state_dict
            from arl.weights.adapter import merge_payload, read_peft_folder

            with open(os.path.join(target.path, "adapter_config.json")) as f:
                base = json.load(f).get("base_model_name_or_path") or ""
            base = base if os.path.isfile(os.path.join(base, "config.json")) else cfg.model.path
            tmp = tempfile.mkdtemp(prefix="arl-eval-model-")
            model_dir = export_final(merge_payload(base_state_dict(base), read_peft_folder(target.path)), base,
                                     os.path.join(tmp, "model"), gen=dataclasses.asdict(cfg.gen), lora_merge=True)
            assert model_dir is not None
            with contextlib.suppress(OSError, ValueError, TypeError):
                with open(os.path.join(target.path, EXPORT_INFO_FILE)) as f:
                    version = int(json.load(f).get("version"))
        else:
            model_dir = target.path
            try:
                with open(os.path.join(model_dir, EXPORT_INFO_FILE)) as f:
                    v = json.load(f).get("version")
                version = int(v) if v is not None else -1
            except (OSError, ValueError):
                pass
        return run_loop(evaluate_model(cfg, model_dir, version), cfg.busy_poll_us)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
