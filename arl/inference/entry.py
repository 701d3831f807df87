"""The inference role's process: its servers, registered with the controller, updated on its command."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from arl.config import (ExperimentConfig, InferenceConfig, RoutingMode, eta_bound, policy_adapters, policy_placement,
                        weights_settings)
from arl.transport.control import SOCKET_OPTIONS, ControlChannel, RoleParts, aclose, bind, host_address, make_socket
from arl.transport.messages import UpdateWeights
from arl.transport.sockets import Router

def frozen_policy_files(cfg: ExperimentConfig, run_dir: str, index: int) -> dict[str, str]:
    """Each listed policy's adapter as a payload file (`arl.weights.adapter`: A, and B scaled) that every engine
    loads by name: under ``<run_dir>/policies/``, written by this process (atomically: a restarted one rewrites)."""
    if not cfg.policies:
        return {}
    import os

    from safetensors.torch import save_file

    from arl.config import BASE_ADAPTER
    from arl.weights.adapter import base_payload, read_peft_folder

    out_dir = os.path.join(run_dir, "policies")
    os.makedirs(out_dir, exist_ok=True)
    out = {}
    for p in cfg.policies:
        path = os.path.join(out_dir, f"{p.name}.inference{index}.safetensors")
        payload = ({k: v.contiguous() for k, v in read_peft_folder(p.adapter).items()} if p.adapter != BASE_ADAPTER
                   else base_payload(cfg.model.path, list(cfg.learner.lora.target_modules)))
        save_file(payload, path + ".tmp", metadata={"format": "pt", "policy": p.name, "payload": "lora"})
        os.replace(path + ".tmp", path)
        out[p.name] = path
    return out


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
    from arl.weights.strategy import make_transport

    ic = cfg.inference
    transport, host = make_transport(weights_settings(cfg)), host_address(cfg.bind_host)
    first = index * ic.servers_per_process
    workers: list[Any] = []
    addresses: list[str] = []
    # a process started by `arl.ctl scale` hosts one server past the configured ones (scaling needs one per process)
    end = min(ic.num_workers, first + ic.servers_per_process) if first < ic.num_workers else first + 1
    frozen, placement = frozen_policy_files(cfg, run_dir, index), policy_placement(cfg)
    named = (len(frozen), *policy_adapters(cfg)) if frozen else (0, 0, ())
    for i in range(first, end):
        # LoRA: a server keeps the adapters of the versions a consumed token may come from (eta + 1)
        engine = build_engine(cfg.model.path, ic, seed=cfg.seed, index=i, run_dir=run_dir, lora=cfg.learner.lora,
                              adapters_keep=eta_bound(cfg) + 1, named=named)
        for name, path in frozen.items():  # before it registers: no request can ask for a policy not loaded yet
            if i in placement.get(name, (i,)):  # a policy placed on some servers is loaded only there
                await engine.update_weights(path, 0, policy=name)
        router = make_socket(Router)
        addresses.append(bind(router, cfg.bind_host))
        weights = transport.inference(engine, host=host, secret=SOCKET_OPTIONS.get("secret"))
        workers.append(InferenceWorker(index=i, engine=engine, router=router, send_control=ctl.post,
                                       weights=weights, feed=routing_feed(ic, i, router)))

    async def on_update(msg: UpdateWeights) -> None:
        if msg.policy is not None:  # a trainable listed policy's adapter: to the one server it names
            await asyncio.gather(*(w.update_policy(msg.version, msg.path, msg.policy) for w in workers
                                   if w.index == msg.index))
            return
        await asyncio.gather(*(w.update_weights(msg.version, msg.path, bool(msg.rollback)) for w in workers))

    def to_server(msg_type: str) -> Callable[[Any], Awaitable[None]]:
        """The transport's command `msg_type`, for the hosted server it names (``index``)."""
        async def handle(msg: Any) -> None:
            for w in workers:
                if w.index == msg.index and msg_type in w.weights.handlers:
                    await w.weights.handlers[msg_type](msg)
        return handle

    ctl.handlers["update_weights"] = on_update  # before registering: a restarted server is sent the newest at once
    for msg_type in sorted({t for w in workers for t in w.weights.handlers} - {"update_weights"}):
        ctl.handlers[msg_type] = to_server(msg_type)  # the weight transport's own commands
    for w, address in zip(workers, addresses):
        await ctl.register(cfg.startup_timeout, index=w.index, address=address)
    return ([*(w.serve() for w in workers), *(ctl.heartbeat(w.heartbeat_stats, w.index) for w in workers),
             *(w.feed.run() for w in workers if w.feed is not None)],
            [*(w.weights.close() for w in workers), *(w.engine.close() for w in workers),
             *(aclose(w.router) for w in workers)])


def routing_feed(ic: InferenceConfig, index: int, router: Any) -> Any:
    """Server `index`'s reports to the routers (`arl.inference.routing_feed`); None with one server or per-worker
    routing (nothing to share)."""
    rc = ic.routing
    if ic.num_workers < 2 or rc.mode != RoutingMode.global_view:
        return None
    from arl.inference.routing_feed import RoutingFeed

    cache = rc.cache_tokens
    if cache < 0:  # the engine's own cache size
        cache = {"torch": ic.torch.prefix_cache_tokens, "sim": ic.sim.cache_tokens}.get(ic.backend, 0)
    return RoutingFeed(index=index, send=router.send_each, block_tokens=rc.block_tokens, cache_tokens=cache,
                       interval_s=rc.publish_interval_s)


async def run_judge(cfg: ExperimentConfig, ctl: ControlChannel, index: int, run_dir: str) -> RoleParts:
    """Judge worker `index`: an inference server of the frozen judge model (`judge.model.path`, `judge.inference`),
    registered as role 'judge'. No weight transport and no `update_weights` handler: the controller's weight sync
    and the staleness gate know only the policy's servers, and a judge's tokens never reach a trajectory."""
    from arl.config import JudgeMode
    from arl.inference.factory import build_engine
    from arl.inference.worker import InferenceWorker

    jc = cfg.judge
    if jc.mode == JudgeMode.classifier:
        from arl.inference.classifier_engine import ClassifierEngine

        engine: Any = ClassifierEngine(jc.model.path, device=jc.inference.device,
                                       max_context_len=jc.inference.max_context_len)
    elif jc.inference.backend == "sglang":  # build_engine's call, under the judge's own name (log, folders)
        from arl.inference.sglang_engine import launch_sglang_engine

        engine = launch_sglang_engine(jc.inference.sglang, model_path=jc.model.path, device=jc.inference.device,
                                      seed=cfg.seed + 7919 + index, name=f"judge{index}", index=index,
                                      run_dir=run_dir, max_batch_size=jc.inference.max_batch_size,
                                      max_context_len=jc.inference.max_context_len)
    else:
        engine = build_engine(jc.model.path, jc.inference, seed=cfg.seed + 7919, index=index, run_dir=run_dir)
    router = make_socket(Router)
    address = bind(router, cfg.bind_host)
    worker = InferenceWorker(index=index, engine=engine, router=router, send_control=ctl.post)
    await ctl.register(cfg.startup_timeout, index=index, address=address)
    return ([worker.serve(), ctl.heartbeat(worker.heartbeat_stats, index)],
            [engine.close(), aclose(router)])
