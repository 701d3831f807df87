"""Entry point of every role process: `python -m arl.launcher.worker --role R --index I --run-dir D --controller A`.

It reads the run's config.yaml, imports the user's modules (so their register_* calls happen here too), sets the
torch thread count, builds the role from plain objects and runs it until the controller says stop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from typing import Any, Awaitable, Callable, Optional

from arl.config import ExperimentConfig, import_user_modules, load_yaml, resolve_threads
from arl.transport.sockets import Dealer, Pull, Push, Router, bind_random

logger = logging.getLogger("arl.worker")

HEARTBEAT_SECONDS = 1.0


class ControlChannel:
    """The role's DEALER to the controller: replies are awaited by type, commands dispatched to handlers."""

    def __init__(self, address: str, role: str, index: int) -> None:
        self.dealer = Dealer().connect(address)
        self.role, self.index = role, index
        self.handlers: dict[str, Callable[[dict], Awaitable[None]]] = {}
        self._waiters: dict[str, asyncio.Future] = {}
        self.stopped = asyncio.Event()
        self.stop_reason = ""

    async def send(self, msg_type: str, payload: dict) -> None:
        await self.dealer.send(msg_type, payload)

    async def request(self, msg_type: str, payload: dict, reply_type: str, timeout: float) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self._waiters[reply_type] = fut
        await self.send(msg_type, payload)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{self.role}{self.index}: no '{reply_type}' from the controller in {timeout}s")

    async def loop(self) -> None:
        while True:
            msg_type, payload = await self.dealer.recv()
            if msg_type in self._waiters:
                fut = self._waiters.pop(msg_type)
                if not fut.done():
                    fut.set_result(payload)
            elif msg_type == "shutdown":
                self.stop_reason = str(payload.get("reason", ""))
                self.stopped.set()
            elif msg_type in self.handlers:
                asyncio.create_task(self._run_handler(msg_type, payload))
            else:
                logger.warning("unexpected control message %s", msg_type)

    async def _run_handler(self, msg_type: str, payload: dict) -> None:
        try:
            await self.handlers[msg_type](payload)
        except Exception as e:  # noqa: BLE001 - report, then let the controller decide
            logger.exception("handler for %s failed", msg_type)
            await self.send("error", {"message": f"{self.role}{self.index}: {msg_type} failed: {e}"})

    async def heartbeat(self, stats: Callable[[], dict]) -> None:
        while True:
            await self.send("heartbeat", {"role": self.role, "index": self.index, "stats": stats()})
            await asyncio.sleep(HEARTBEAT_SECONDS)

    def close(self) -> None:
        self.dealer.close()


def _host(cfg: ExperimentConfig) -> str:
    return os.environ.get("ARL_BIND_HOST", "127.0.0.1")


# -- roles ---------------------------------------------------------------------------------------------------------
RoleParts = tuple[list[Awaitable], list[Awaitable]]  # (coroutines to run, cleanups)


async def run_inference(cfg: ExperimentConfig, ctl: ControlChannel, index: int, run_dir: str) -> RoleParts:
    from arl.inference.factory import build_engine
    from arl.inference.worker import InferenceWorker

    ic = cfg.inference
    engine = build_engine(ic.backend, model_path=cfg.model.path, device=ic.device, max_batch_size=ic.max_batch_size,
                          max_context_len=ic.max_context_len, seed=cfg.seed * 1000 + index,
                          name=f"inference{index}", index=index, run_dir=run_dir)
    router = Router()
    address = bind_random(router, _host(cfg))
    worker = InferenceWorker(index=index, engine=engine, router=router, send_control=ctl.send)

    async def on_update(p: dict) -> None:
        await worker.update_weights(int(p["version"]), str(p["path"]))

    ctl.handlers["update_weights"] = on_update
    await ctl.request("register", {"role": "inference", "index": index, "address": address, "pid": os.getpid()},
                      "ack", cfg.startup_timeout)
    return [worker.serve(), ctl.heartbeat(worker.heartbeat_stats)], [engine.close(), _aclose(router)]


async def run_learner(cfg: ExperimentConfig, ctl: ControlChannel, index: int, run_dir: str) -> RoleParts:
    from arl.learner.deepspeed_engine import DeepSpeedLearner
    from arl.learner.worker import LearnerWorker
    from arl.models.tiny import load_model_dir

    model, _ = load_model_dir(cfg.model.path)
    lc = cfg.learner
    engine = DeepSpeedLearner(
        model,
        lr=lc.lr,
        betas=tuple(lc.betas),
        weight_decay=lc.weight_decay,
        grad_clip=lc.grad_clip,
        zero_stage=lc.zero_stage,
        offload_optimizer=lc.offload_optimizer,
        bf16=lc.bf16,
        max_tokens_per_mb=lc.max_tokens_per_mb,
        eps_clip=lc.eps_clip,
        behav_imp_weight_cap=lc.behav_imp_weight_cap,
        naive_ppo=lc.naive_ppo,
        adv_std_norm=lc.adv_std_norm,
        temperature=cfg.gen.temperature,
        version=0,
        seed=cfg.seed,
    )
    pull = Pull()
    address = bind_random(pull, _host(cfg))
    worker = LearnerWorker(
        engine=engine,
        pull=pull,
        send_control=ctl.send,
        batch_size=lc.batch_size,
        total_steps=cfg.total_train_steps,
        weights_dir=os.path.join(run_dir, "weights"),
        keep_versions=lc.keep_weight_versions,
        max_head_offpolicyness=cfg.max_head_offpolicyness,
    )
    await ctl.request("register", {"role": "learner", "index": 0, "address": address, "pid": os.getpid()},
                      "ack", cfg.startup_timeout)
    return [worker.receive(), worker.train(), ctl.heartbeat(worker.heartbeat_stats)], [_aclose(pull)]


async def run_rollout(cfg: ExperimentConfig, ctl: ControlChannel, index: int, run_dir: str) -> RoleParts:
    from arl.api.registry import AGENTS, make_env
    from arl.api.types import GenerationConfig
    from transformers import PreTrainedTokenizerFast

    from arl.data.splits import load_splits
    from arl.rollout.client import InferenceClient
    from arl.rollout.worker import PromptStream, RolloutWorker

    AGENTS.get(cfg.agent.name)  # fail fast, listing what is registered
    make_env(cfg.env.name, **cfg.env.args)
    tok = PreTrainedTokenizerFast.from_pretrained(cfg.model.path)
    d = cfg.dataset
    train_rows, test_rows = load_splits(name=d.name, train_path=d.train_path, test_path=d.test_path,
                                        max_operand=d.max_operand, test_size=d.test_size, seed=0)
    gconfig = GenerationConfig(
        n=1,
        max_new_tokens=cfg.gen.max_new_tokens,
        min_new_tokens=cfg.gen.min_new_tokens,
        temperature=cfg.gen.temperature,
        top_p=cfg.gen.top_p,
        top_k=cfg.gen.top_k,
    )
    gconfig.validate()
    agent_cls = AGENTS.get(cfg.agent.name)

    def make_agent() -> Any:
        return _construct(agent_cls, tokenizer=tok, gconfig=gconfig, group_size=cfg.agent.group_size,
                          **cfg.agent.args)

    def make_eval_agent() -> Any:
        return _construct(agent_cls, tokenizer=tok, gconfig=gconfig.new(greedy=True), group_size=1,
                          filter_uniform_groups=False, **cfg.agent.args)

    addrs = await ctl.request("lookup", {"role": "rollout", "index": index}, "addresses", cfg.startup_timeout)
    client = InferenceClient([Dealer().connect(a) for a in addrs["inference"]], request_timeout=cfg.rollout.request_timeout)
    client.start()
    push = Push().connect(addrs["learner"])
    per_worker = max(1, cfg.rollout.max_concurrent_rollouts // cfg.rollout.num_workers)
    worker = RolloutWorker(
        index=index,
        make_agent=make_agent,
        make_eval_agent=make_eval_agent,
        make_env=lambda: make_env(cfg.env.name, **cfg.env.args),
        prompts=PromptStream(train_rows, seed=cfg.seed, shard=index, num_shards=cfg.rollout.num_workers),
        test_rows=test_rows,
        client=client,
        send_control=ctl.send,
        push_group=lambda group: push.send("traj", group),
        capacity=per_worker,
        trajectory_timeout=cfg.rollout.trajectory_timeout,
        eval_concurrency=cfg.eval.concurrency,
        seed=cfg.seed,
    )

    async def on_grant(p: dict) -> None:
        worker.on_grant(int(p["n"]))

    async def on_eval(p: dict) -> None:
        result = await worker.evaluate(int(p["version"]), int(p.get("max_prompts", 0)))
        await ctl.send("eval_done", result)

    ctl.handlers["gate_grant"] = on_grant
    ctl.handlers["eval"] = on_eval
    await ctl.request("register", {"role": "rollout", "index": index, "pid": os.getpid()}, "ack",
                      cfg.startup_timeout)
    return [worker.acquire_loop(), ctl.heartbeat(worker.heartbeat_stats)], [worker.close(), client.close(),
                                                                              _aclose(push)]


def _construct(cls: Any, **kwargs: Any) -> Any:
    """Pass only the keyword arguments the agent's constructor accepts (user agents need not take them all)."""
    import inspect

    sig = inspect.signature(cls)
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return cls(**kwargs)
    return cls(**{k: v for k, v in kwargs.items() if k in sig.parameters})


async def _aclose(sock: Any) -> None:
    sock.close()


ROLES = {"inference": run_inference, "learner": run_learner, "rollout": run_rollout}


async def amain(cfg: ExperimentConfig, role: str, index: int, controller: str, run_dir: str) -> int:
    ctl = ControlChannel(controller, role, index)
    ctl_task = asyncio.create_task(ctl.loop())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ctl.stopped.set)
    cleanups: list[Awaitable] = []
    tasks: list[asyncio.Task] = []
    try:
        coros, cleanups = await ROLES[role](cfg, ctl, index, run_dir)
        tasks = [asyncio.create_task(c) for c in coros]
        stop = asyncio.create_task(ctl.stopped.wait())
        done, _ = await asyncio.wait([*tasks, stop], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not stop and t.exception() is not None:
                raise t.exception()
        if stop not in done:  # a role task finished by itself (the learner's train loop): wait to be stopped
            await ctl.stopped.wait()
        return 0
    except Exception as e:
        logger.exception("%s%d failed", role, index)
        try:
            await asyncio.wait_for(ctl.send("error", {"message": f"{role}{index}: {type(e).__name__}: {e}"}), 1.0)
        except Exception:  # noqa: BLE001
            pass
        return 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in cleanups:
            try:
                await asyncio.wait_for(c, 5.0)
            except Exception:  # noqa: BLE001
                pass
        ctl_task.cancel()
        ctl.close()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", required=True, choices=sorted(ROLES))
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--controller", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s {args.role}{args.index} %(levelname)s %(name)s: %(message)s")
    from omegaconf import OmegaConf

    from arl.api.registry import EXPERIMENTS
    from arl.builtin import load_builtins

    cfg_path = os.path.join(args.run_dir, "config.yaml")
    raw = OmegaConf.load(cfg_path)
    load_builtins()
    import_user_modules(list(raw.get("imports", [])))
    cfg: ExperimentConfig = load_yaml(cfg_path, EXPERIMENTS.get(str(raw.get("experiment", "async-ppo-math"))))
    threads = resolve_threads(cfg, args.role)
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    logger.info("starting %s%d (pid %d, %d torch threads)", args.role, args.index, os.getpid(), threads)
    t0 = time.monotonic()
    code = asyncio.run(amain(cfg, args.role, args.index, args.controller, args.run_dir))
    logger.info("%s%d exiting with %d after %.1fs", args.role, args.index, code, time.monotonic() - t0)
    return code


if __name__ == "__main__":
    sys.exit(main())
