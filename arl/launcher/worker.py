"""Entry point of every role process: `python -m arl.launcher.worker --role R --index I --run-dir D --controller A`.

It reads the run's config.yaml, imports the user's modules (so their register_* calls happen here too), sets the
torch thread count, builds the role from plain objects and runs it until the controller says stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import inspect
import logging
import os
import signal
import sys
import time
from typing import Any, Awaitable, Callable, Optional, TypeVar

from arl.config import ExperimentConfig, WeightTransport, import_user_modules, resolve_threads, \
    rollout_deadlines, weights_backend
from arl.launcher.forensics import install_stack_dump_handler
from arl.launcher.messages import ControlMessage, Error, Eval, Heartbeat, JoinWeightGroup, \
    Lookup, Register, UpdateWeights, WorkerBack, WorkerLost, parse
from arl.launcher.security import advertised_address, effective_bind_host, resolve_secret
from arl.transport.sockets import Dealer, Pull, Push, Router, bind_random
from arl.transport.loop import run as run_loop

logger = logging.getLogger("arl.worker")

# Every socket this process makes gets the run's shared secret (HMAC on every frame) and frame-size limit; main()
# fills this in before any socket exists.
SOCKET_OPTIONS: dict[str, Any] = {}
_S = TypeVar("_S")


def _socket(cls: Callable[..., _S]) -> _S:
    return cls(**SOCKET_OPTIONS)


def _host(cfg: ExperimentConfig) -> str:
    """This machine's address on the run's interface (a wildcard bind host: its own address), for gloo."""
    return advertised_address(f"tcp://{effective_bind_host(cfg.bind_host)}:0")[len("tcp://"):].rsplit(":", 1)[0]


def _bind(sock: Any, cfg: ExperimentConfig) -> str:
    """Bind to a free port on the run's host; the returned address is one other machines can use (no wildcard)."""
    return advertised_address(bind_random(sock, effective_bind_host(cfg.bind_host)))


HEARTBEAT_SECONDS = 1.0


class ControlChannel:
    """The role's DEALER to the controller: replies are awaited by type, commands dispatched to handlers."""

    def __init__(self, address: str, role: str, index: int) -> None:
        self.dealer = _socket(Dealer).connect(address)
        self.role, self.index = role, index
        # command type -> handler of its typed message (a coroutine function, or a plain one for a quick command)
        self.handlers: dict[str, Callable[[Any], Any]] = {}
        self._waiters: dict[str, asyncio.Future] = {}
        self.stopped = asyncio.Event()

    async def post(self, msg: ControlMessage) -> None:
        """Send a typed control message (a plain map on the wire)."""
        await self.dealer.send(msg.TYPE, msg.to_payload())

    async def register(self, timeout: float, index: Optional[int] = None, address: Optional[str] = None,
                       weights_store: Optional[str] = None) -> dict:
        """Register as this role (or as hosted inference server `index`); returns the controller's ack."""
        return await self.request(Register(role=self.role, index=self.index if index is None else index,
                                           address=address, pid=os.getpid(), weights_store=weights_store),
                                  "ack", timeout)

    async def request(self, msg: ControlMessage, reply_type: str, timeout: float) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self._waiters[reply_type] = fut
        await self.post(msg)
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
                self.stopped.set()
            elif msg_type in self.handlers:
                asyncio.create_task(self._run_handler(msg_type, payload))
            else:
                logger.warning("unexpected control message %s", msg_type)

    async def _run_handler(self, msg_type: str, payload: dict) -> None:
        try:  # the handler gets the typed command; a malformed one is reported like a failed handler
            result = self.handlers[msg_type](parse(msg_type, payload))
            if inspect.isawaitable(result):
                await result
        except Exception as e:  # noqa: BLE001 - report, then let the controller decide
            logger.exception("handler for %s failed", msg_type)
            await self.post(Error(message=f"{self.role}{self.index}: {msg_type} failed: {e}"))

    async def heartbeat(self, stats: Callable[[], dict], index: Optional[int] = None) -> None:
        """Heartbeat as this role (or as hosted inference server `index`) every HEARTBEAT_SECONDS."""
        while True:
            await self.post(Heartbeat(role=self.role, index=self.index if index is None else index, stats=stats()))
            await asyncio.sleep(HEARTBEAT_SECONDS)


# -- roles ---------------------------------------------------------------------------------------------------------
RoleParts = tuple[list[Awaitable], list[Awaitable]]  # (coroutines to run, cleanups)


async def run_inference(cfg: ExperimentConfig, ctl: ControlChannel, index: int, run_dir: str) -> RoleParts:
    """The process's inference servers: `inference.servers_per_process` of them (indices index*k .. index*k+k-1).

    Why several: 64 simulated servers as 64 Python processes would not fit a 2-core machine (each idles at tens of
    MB and wakes for heartbeats), while the event-driven sim engine costs only per request. Each hosted server
    is still a separate engine behind its own ROUTER socket and address, registers under its own index and
    heartbeats for it, so the controller, routing and transport see N servers exactly as with N processes.
    The controller sends `update_weights` once per server; the first message for a version updates all of
    them (concurrently), later copies are ignored by the servers that have or load it (a retry after a failed
    load reaches the one that failed), and each server acks with its own index.
    """
    from arl.inference.factory import build_engine
    from arl.inference.worker import InferenceWorker

    ic = cfg.inference
    first = index * ic.servers_per_process
    workers: list[Any] = []
    addresses: list[str] = []
    for i in range(first, min(ic.num_workers, first + ic.servers_per_process)):
        engine = build_engine(cfg.model.path, ic, seed=cfg.seed, index=i, run_dir=run_dir)
        router = _socket(Router)
        addresses.append(_bind(router, cfg))
        loader = None
        if cfg.weights.transport == WeightTransport.broadcast:
            from arl.weights.channel import BroadcastLoader

            loader = BroadcastLoader(engine, timeout_s=cfg.weights.timeout_s, gloo_host=_host(cfg),
                                     secret=SOCKET_OPTIONS.get("secret"))
        workers.append(InferenceWorker(index=i, engine=engine, router=router, send_control=ctl.dealer.send,
                                       loader=loader))

    async def on_update(msg: UpdateWeights) -> None:
        await asyncio.gather(*(w.update_weights(msg.version, msg.path) for w in workers))

    async def on_join(msg: JoinWeightGroup) -> None:  # broadcast: the group later updates come through
        from arl.weights.broadcast import GroupSpec

        for w in workers:
            if w.index == msg.index and w.loader is not None:
                await w.loader.join(GroupSpec.from_dict(msg.spec))

    ctl.handlers["update_weights"] = on_update  # before registering: a restarted server is sent the newest at once
    ctl.handlers["join_weight_group"] = on_join
    for w, address in zip(workers, addresses):
        await ctl.register(cfg.startup_timeout, index=w.index, address=address)
    return ([*(w.serve() for w in workers), *(ctl.heartbeat(w.heartbeat_stats, w.index) for w in workers)],
            [*(w.loader.close() for w in workers if w.loader is not None), *(w.engine.close() for w in workers),
             *(_aclose(w.router) for w in workers)])


def _learner_actor(cfg: ExperimentConfig) -> tuple[Any, Any]:
    """This rank's PPO actor on the configured backend's engine, and the backend's entry."""
    from arl.learner.actor import PPOActor
    from arl.learner.backends import LEARNER_BACKENDS

    backend = LEARNER_BACKENDS.get(cfg.learner.backend)
    actor = PPOActor(backend.build(cfg), cfg.learner.ppo, temperature=cfg.gen.temperature,
                     eta=cfg.max_head_offpolicyness)
    return actor, backend


def weight_publisher(cfg: ExperimentConfig, device: Any) -> Any:
    """Learner rank 0's `WeightPublisher` (weights.transport=broadcast). Over NCCL its buckets live on `device`,
    the GPU the engine trains on (NCCL takes CUDA tensors only); over gloo on the CPU."""
    from arl.weights.broadcast import WeightSender
    from arl.weights.channel import WeightPublisher

    host, backend = _host(cfg), weights_backend(cfg)
    sender = WeightSender(host, 0, backend=backend, timeout_s=cfg.weights.timeout_s, gloo_host=host,
                          device=device if backend == "nccl" else None, secret=SOCKET_OPTIONS.get("secret"))
    return WeightPublisher(sender, protocol="sglang" if cfg.inference.backend == "sglang" else "arl",
                           bucket_bytes=cfg.weights.bucket_mb << 20)


async def run_learner(cfg: ExperimentConfig, ctl: ControlChannel, index: int, run_dir: str) -> RoleParts:
    from arl.learner.ranks import RankLeader
    from arl.learner.worker import LearnerWorker

    lc = cfg.learner
    actor, backend = _learner_actor(cfg)
    # learner.num_ranks > 1: the other ranks follow (see `main`); rank 0 drives them all
    leader = RankLeader(actor) if actor.engine.world_size > 1 else None
    pull = _socket(Pull)
    address = _bind(pull, cfg)
    real = backend.trains_model  # the simulated backend neither checkpoints nor checks token ids
    publisher, skip = None, set()
    if cfg.weights.transport == WeightTransport.broadcast:  # rank 0 sends the weights; no file is written
        from arl.learner.export import tied_aliases

        publisher = weight_publisher(cfg, getattr(actor.engine, "device", None))
        skip = tied_aliases(cfg.model.path)

    def write_final(weights: Any, version: int) -> None:
        """Writes ``<run>/final/`` (see `arl.learner.export`) from the last step's weights (file or state dict)."""
        from arl.learner.export import export_final

        out = export_final(weights, cfg.model.path, os.path.join(run_dir, "final"), gen=dataclasses.asdict(cfg.gen),
                           version=version)
        logger.info("final model written to %s", out)

    worker = LearnerWorker(
        actor=leader or actor,
        engine=leader or actor.engine,
        pull=pull,
        send_control=ctl.dealer.send,
        batch_size=lc.batch_size,
        total_steps=cfg.total_train_steps,
        weights_dir=os.path.join(run_dir, "weights"),
        keep_versions=lc.keep_weight_versions,
        max_head_offpolicyness=cfg.max_head_offpolicyness,
        stale_tokens=str(lc.ppo.stale_tokens),
        checkpoint_dir=os.path.join(run_dir, "checkpoints") if real else None,
        checkpoint_every=lc.checkpoint_every,
        keep_checkpoints=lc.keep_checkpoints,
        vocab_size=_vocab_size(cfg) if real else None,
        export_final=write_final if real else None,
        publisher=publisher,
        skip_names=skip,
    )

    # the controller's prune_weights: no server reads versions below msg.below again
    ctl.handlers["prune_weights"] = lambda msg: worker.prune_below(msg.below)
    if publisher is not None:
        ctl.handlers.update(open_weight_group=lambda msg: publisher.open_group(msg.name, msg.server),
                            send_weights=lambda msg: publisher.request(msg.version, msg.servers))
    if cfg.recover == "auto":
        await worker.resume()  # before registering: the controller sends the exported weights to inference
    store = f"{publisher.sender.address}:{publisher.sender.port}" if publisher is not None else None
    await ctl.register(cfg.startup_timeout, address=address, weights_store=store)
    coros = [worker.receive(), worker.train(), ctl.heartbeat(worker.heartbeat_stats)]
    cleanups = [_aclose(pull)]
    if publisher is not None:
        coros.append(publisher.run())
        cleanups.append(asyncio.to_thread(publisher.close))
    if leader is not None:
        cleanups.append(asyncio.to_thread(leader.stop))  # release the follower ranks
    return coros, cleanups


@dataclasses.dataclass
class AgentParts:
    """What a rollout worker builds its agents from; `scripts/evaluate.py` builds the same for its evaluation."""

    tokenizer: Any
    train_rows: list[dict]
    test_rows: list[dict]
    group_size: int
    make_agent: Callable[[], Any]
    make_eval_agent: Callable[[], Any]


def agent_parts(cfg: ExperimentConfig) -> AgentParts:
    """The tokenizer of `model.path`, the data splits and the agent factories (training and greedy evaluation)."""
    from arl.api.registry import AGENTS, make_env
    from arl.api.types import GenerationConfig
    from transformers import PreTrainedTokenizerFast

    from arl.data.splits import load_splits

    agent_cls = AGENTS.get(cfg.agent.name)  # fail fast, listing what is registered
    make_env(cfg.env.name, **cfg.env.args)
    tok = PreTrainedTokenizerFast.from_pretrained(cfg.model.path)
    d = cfg.dataset
    train_rows, test_rows = load_splits(name=d.name, train_path=d.train_path, test_path=d.test_path,
                                        max_operand=d.max_operand, test_size=d.test_size, seed=0,
                                        prompt_field=d.prompt_field, answer_field=d.answer_field)
    gconfig = GenerationConfig(n=1, **dataclasses.asdict(cfg.gen))
    gconfig.validate()
    group_size = cfg.rollout.group_size or cfg.agent.group_size  # env group size = trajectories per prompt

    def make_agent() -> Any:
        return _construct(agent_cls, tokenizer=tok, gconfig=gconfig, group_size=group_size, **cfg.agent.args)

    def make_eval_agent() -> Any:
        # agent.args may set filter_uniform_groups too: evaluation always keeps every prompt
        return _construct(agent_cls, tokenizer=tok, gconfig=gconfig.new(greedy=True), group_size=1,
                          **{**cfg.agent.args, "filter_uniform_groups": False})

    return AgentParts(tok, list(train_rows), list(test_rows), group_size, make_agent, make_eval_agent)


def inference_client(cfg: ExperimentConfig, dealers: list[Any]) -> Any:
    """A rollout worker's (started) client of the inference servers behind `dealers`."""
    from arl.rollout.client import InferenceClient

    base, per_token, _ = rollout_deadlines(cfg)  # 0 = auto: from the generation budget
    client = InferenceClient(dealers, request_timeout=base, timeout_per_token=per_token)
    client.start()
    return client


def rollout_worker(cfg: ExperimentConfig, parts: AgentParts, client: Any, *, index: int, prompts: Any,
                   capacity: int, send_control: Callable[..., Awaitable[None]],
                   push_group: Callable[[Any], Awaitable[None]]) -> Any:
    """Rollout worker `index`, as the run and `arl.launcher.evaluate` build it."""
    from arl.api.registry import make_env
    from arl.rollout.env_groups import worker_spec
    from arl.rollout.worker import RolloutWorker

    rc = cfg.rollout
    return RolloutWorker(
        index=index,
        make_agent=parts.make_agent,
        make_eval_agent=parts.make_eval_agent,
        make_env=lambda: make_env(cfg.env.name, **cfg.env.args),
        prompts=prompts,
        test_rows=parts.test_rows,
        client=client,
        send_control=send_control,
        push_group=push_group,
        capacity=capacity,
        trajectory_timeout=rollout_deadlines(cfg)[2],
        eval_concurrency=cfg.eval.concurrency,
        seed=cfg.seed,
        env_timeout=rc.env_timeout,
        # this worker's env groups (tags, pooled group indices) from `rollout.*`
        env_groups=worker_spec(make_env=make_env, env_name=cfg.env.name, env_args=dict(cfg.env.args),
                               group_size=parts.group_size, num_env_groups=rc.num_env_groups, tags=list(rc.tags),
                               num_groups_partition=list(rc.num_groups_partition),
                               max_env_num_per_worker=rc.max_env_num_per_worker, env_configs=dict(rc.env_configs),
                               num_workers=rc.num_workers, worker=index),
        filter_void_turns=rc.filter_void_turns,
        filter_uniform_groups=rc.filter_uniform_groups,
        verify_token_ledger=rc.verify_token_ledger,
        tokenizer=parts.tokenizer,  # trajectory traces decode with it
        trace_rate=rc.trace_rate,
    )


async def run_rollout(cfg: ExperimentConfig, ctl: ControlChannel, index: int, run_dir: str) -> RoleParts:
    from arl.rollout.worker import PromptStream

    parts = agent_parts(cfg)
    addrs = await ctl.request(Lookup(role="rollout", index=index), "addresses", cfg.startup_timeout)
    push = _socket(Push).connect(addrs["learner"])
    prompts = PromptStream(parts.train_rows, seed=cfg.seed, shard=index, num_shards=cfg.rollout.num_workers)
    client = inference_client(cfg, [_socket(Dealer).connect(a) for a in addrs["inference"]])
    per_worker = max(1, cfg.rollout.max_concurrent_rollouts // cfg.rollout.num_workers)
    worker = rollout_worker(cfg, parts, client, index=index, prompts=prompts, capacity=per_worker,
                            send_control=ctl.dealer.send, push_group=lambda group: push.send("traj", group))

    async def on_eval(msg: Eval) -> None:
        result = await worker.evaluate(msg.version, msg.max_prompts)
        # fresh counters first (same socket, so they arrive first): the eval record carries this worker's stats as
        # of the evaluation, not a heartbeat up to a second old (a short run can finish within one heartbeat)
        await ctl.post(Heartbeat(role="rollout", index=index, stats=worker.heartbeat_stats()))
        await ctl.dealer.send("eval_done", result)

    async def on_worker_lost(msg: WorkerLost) -> None:  # the controller dropped an inference server: re-route
        if msg.role == "inference":
            for i in msg.indices:
                await client.worker_lost(i)

    async def on_worker_back(msg: WorkerBack) -> None:  # the controller restarted an inference server: route to it
        if msg.role == "inference":
            client.worker_back(msg.index, _socket(Dealer).connect(msg.address))

    ctl.handlers.update(gate_grant=lambda msg: worker.on_grant(msg.n), eval=on_eval, worker_lost=on_worker_lost,
                        worker_back=on_worker_back)
    ack = await ctl.register(cfg.startup_timeout)
    if ack.get("prompt_position"):  # resuming a run: continue this worker's prompt stream where it stood
        prompts.seek(int(ack["prompt_position"]))
        logger.info("rollout%d: prompt stream resumes at position %d", index, prompts.position)
    return [worker.acquire_loop(), ctl.heartbeat(worker.heartbeat_stats)], [worker.close(), client.close(),
                                                                              _aclose(push)]


def _vocab_size(cfg: ExperimentConfig) -> Optional[int]:
    """The model's vocabulary size (from its config.json): token ids the learner accepts are below it."""
    import json

    try:
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _construct(cls: Any, **kwargs: Any) -> Any:
    """Pass only the keyword arguments the agent's constructor accepts (user agents need not take them all)."""
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
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ctl.post(Error(message=f"{role}{index}: {type(e).__name__}: {e}")), 1.0)
        return 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in cleanups:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c, 5.0)
        ctl_task.cancel()
        ctl.dealer.close()


def load_run_config(path: str) -> ExperimentConfig:
    """A run's config.yaml, as its experiment's config class, after the builtins and the modules it imports
    (the experiment's own module is one, see arl.cli) registered what they define."""
    from omegaconf import OmegaConf

    from arl.api.registry import EXPERIMENTS
    from arl.builtin import load_builtins

    raw = OmegaConf.load(path)
    load_builtins()
    import_user_modules(list(raw.get("imports", [])))
    cls = EXPERIMENTS.get(str(raw.get("experiment", "async-ppo-math")))
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), raw))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", required=True, choices=sorted(ROLES))
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--controller", required=True)
    args = ap.parse_args(argv)
    name = f"{args.role}{args.index}"
    ranked = args.role == "learner" and int(os.environ.get("WORLD_SIZE", "1")) > 1  # learner under torchrun
    if ranked:
        from arl.utils.proc import die_with_parent

        die_with_parent()  # torchrun starts each rank in a session of its own: die with torchrun
        name += f"-rank{os.environ.get('RANK', '?')}"
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    cfg = load_run_config(os.path.join(args.run_dir, "config.yaml"))
    install_stack_dump_handler()  # SIGUSR1 -> every thread's stack in this role's log (the controller asks)
    SOCKET_OPTIONS.update(secret=resolve_secret(cfg.secret, effective_bind_host(cfg.bind_host)),
                          max_bytes=cfg.max_message_bytes)
    threads = resolve_threads(cfg, args.role)
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    logger.info("starting %s%d (pid %d, %d torch threads%s)", args.role, args.index, os.getpid(), threads,
                f", busy poll {cfg.busy_poll_us:g} us" if cfg.busy_poll_us > 0 else "")
    t0 = time.monotonic()
    if ranked and int(os.environ["RANK"]) > 0:
        # rank 0 runs the role; this rank builds the same engine and actor (DeepSpeed's collectives line up),
        # resumes like rank 0, then runs rank 0's commands until it says stop (see `arl.learner.ranks`)
        from arl.learner.ranks import follow

        actor, _ = _learner_actor(cfg)
        logger.info("learner rank %d done after %d steps", actor.engine.rank, follow(actor))
        return 0
    code = run_loop(amain(cfg, args.role, args.index, args.controller, args.run_dir), cfg.busy_poll_us)
    logger.info("%s%d exiting with %d after %.1fs", args.role, args.index, code, time.monotonic() - t0)
    return code


if __name__ == "__main__":
    sys.exit(main())
