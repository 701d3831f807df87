"""The rollout role's process: its agents, env groups and inference client, and the pieces the offline
evaluator (`arl.evaluate`) builds the same way."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
from typing import Any, Awaitable, Callable, Optional

from arl.config import ExperimentConfig, RoutingMode, policy_placement, rollout_deadlines
from arl.transport.control import ControlChannel, RoleParts, make_socket
from arl.transport.messages import (AdoptStreams, Eval, EvalDone, LearnerRestarted, Lookup, SendControl, WorkerBack,
                                    WorkerDraining, WorkerLost)
from arl.transport.sockets import Dealer, Push

logger = logging.getLogger("arl.worker")

@dataclasses.dataclass
class AgentParts:
    """What a rollout worker builds its agents from; `scripts/evaluate.py` builds the same for its evaluation."""

    tokenizer: Any
    train_rows: list[dict]
    test_rows: list[dict]
    group_size: int
    make_agent: Callable[[], Any]
    make_eval_agent: Callable[[], Any]
    endpoint: Any = None  # the OpenAI-compatible endpoint (`arl.rollout.endpoint`) when the agent is a function


def agent_parts(cfg: ExperimentConfig, index: int = 0) -> AgentParts:
    """The tokenizer of `model.path`, the data splits and the agent factories (training and greedy evaluation) of
    rollout worker `index`."""
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
                                        prompt_field=d.prompt_field, answer_field=d.answer_field,
                                        tasks=list(d.tasks), train_size=d.train_size,
                                        verifiers_env=d.verifiers_env, verifiers_args=dict(d.verifiers_args))
    gconfig = GenerationConfig(n=1, **dataclasses.asdict(cfg.gen))
    gconfig.validate()
    group_size = cfg.rollout.group_size or cfg.agent.group_size  # env group size = trajectories per prompt

    parser = tool_parser(cfg.rollout.tool_parser, tok)
    if inspect.iscoroutinefunction(agent_cls) or is_external(agent_cls):  # the endpoint serves these agents
        return _endpoint_parts(cfg, agent_cls, tok, gconfig, group_size, list(train_rows), list(test_rows), index,
                               parser)

    # an agent that names `held_out` in its signature gets the held-out rows: one that writes its own problems
    # (proposer-solver) must never write one of them
    held_out = {"held_out": list(test_rows)} if "held_out" in inspect.signature(agent_cls).parameters else {}

    def make_agent() -> Any:
        return construct(agent_cls, tokenizer=tok, gconfig=gconfig, group_size=group_size,
                         **{"parser": parser, **held_out, **cfg.agent.args})

    def make_eval_agent() -> Any:
        # agent.args may set filter_uniform_groups too: evaluation always keeps every prompt
        return construct(agent_cls, tokenizer=tok, gconfig=gconfig.new(greedy=True), group_size=1,
                         **{"parser": parser, **held_out, **cfg.agent.args, "filter_uniform_groups": False})

    return AgentParts(tok, list(train_rows), list(test_rows), group_size, make_agent, make_eval_agent)


def is_external(agent_cls: Any) -> bool:
    """`agent.name=external`: episodes of the task API, run by agents outside the run. Asked without importing the
    module (a run with another agent imports neither the endpoint nor `openai`): the class is loaded if it is this."""
    module = sys.modules.get("arl.rollout.external_agent")
    return module is not None and agent_cls is module.ExternalAgent


def tool_parser(name: str, tok: Any) -> str:
    """`rollout.tool_parser` as a registered name (auto: the one the chat template names)."""
    from arl.tools.parsers import parser_for_template

    return parser_for_template(tok) if name == "auto" else name


def _endpoint_parts(cfg: ExperimentConfig, fn: Any, tok: Any, gconfig: Any, group_size: int, train_rows: list[dict],
                    test_rows: list[dict], index: int = 0, parser: str = "hermes") -> AgentParts:
    """AgentParts of an OpenAI-API agent function: one endpoint per rollout worker, on the role's bind host (loopback
    by default) and `rollout.endpoint_port` + `index` (one fixed port for every worker would refuse all but the
    first). Each session has its own bearer token: the run's secret is neither the endpoint's key nor left in the
    environment that the agent functions' subprocesses inherit."""
    from arl.agents.common import agent_gconfig
    from arl.rollout.endpoint import EndpointServer
    from arl.rollout.openai_agent import EndpointAgent
    from arl.rollout.session_slots import session_limit
    from arl.transport.security import SECRET_ENV, effective_bind_host

    # the role read it into SOCKET_OPTIONS at start-up; user agent code runs in this process from here on
    os.environ.pop(SECRET_ENV, None)
    external = is_external(fn)
    params = {} if external else inspect.signature(fn).parameters
    # an in-process client, or agents elsewhere (external): sessions cost this worker no process; else the function
    # makes its own client or process per session, and auto caps how many run at once
    in_process = external or "client" in params or "anthropic" in params
    server = EndpointServer(tok, agent_gconfig(gconfig, tok), cfg.inference.max_context_len,
                            host=effective_bind_host(cfg.bind_host),
                            port=endpoint_port(cfg.rollout.endpoint_port, index), vocab_size=len(tok), parser=parser,
                            max_sessions=session_limit(cfg.rollout.max_concurrent_sessions, in_process),
                            task_key=cfg.rollout.task_api_key if external else "",
                            policies=[p.name for p in cfg.policies])
    args = dict(cfg.agent.args)
    filter_uniform = bool(args.pop("filter_uniform_groups", False))
    if external:
        from arl.rollout.external_agent import ExternalAgent

        deadline = rollout_deadlines(cfg)[2]
        return AgentParts(tok, train_rows, test_rows, group_size,
                          lambda: ExternalAgent(server, group_size, deadline, filter_uniform_groups=filter_uniform),
                          lambda: ExternalAgent(server, 1, deadline, greedy=True), endpoint=server)

    def make_agent() -> Any:
        return EndpointAgent(fn, server, group_size, filter_uniform_groups=filter_uniform, args=args)

    def make_eval_agent() -> Any:
        return EndpointAgent(fn, server, 1, greedy=True, args=args)

    return AgentParts(tok, train_rows, test_rows, group_size, make_agent, make_eval_agent, endpoint=server)


def saturation_watch(agent: str, slots: Any) -> Callable[[], dict]:
    """Heartbeat fields: once the agent saturates the machine (`SaturationWatch`), a `warning` naming it and what
    to change (logged once here; the controller says it once on the console)."""
    from arl.rollout.session_slots import SaturationWatch

    watch = SaturationWatch(agent, slots)

    def fields() -> dict:
        said = watch.said
        text = watch.check()
        if text is not None and said is None:
            logger.warning("%s", text)
        return {"warning": text} if text else {}

    return fields


def write_task_api_file(run_dir: str, index: int, server: Any) -> str:
    """<run_dir>/task_api/rollout<index>.json: the worker's task API address and key (readable by its owner only),
    what an agent outside the run reads to take episodes."""
    import json

    folder = os.path.join(run_dir, "task_api")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rollout{index}.json")
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"worker": index, "url": server.url, "episodes": server.url + "/rl/v1/episodes",
                   "key": server.task_key}, f)
    os.replace(path + ".tmp", path)
    return path


def endpoint_port(base: int, index: int) -> int:
    """Rollout worker `index`'s endpoint port: `base` + `index` (0: a free port, for every worker)."""
    return base + index if base else 0


def inference_client(cfg: ExperimentConfig, dealers: list[Any]) -> Any:
    """A rollout worker's (started) client of the inference servers behind `dealers`."""
    from arl.rollout.client import InferenceClient

    base, per_token, _ = rollout_deadlines(cfg)  # 0 = auto: from the generation budget
    rc, view = cfg.inference.routing, None
    if rc.mode == RoutingMode.global_view and len(dealers) > 1:  # one view of every server's load and cache
        from arl.rollout.routing import RoutingView

        view = RoutingView(len(dealers), block_tokens=rc.block_tokens, load_weight=rc.load_weight,
                           sticky_slack=rc.sticky_slack)
    client = InferenceClient(dealers, request_timeout=base, timeout_per_token=per_token, view=view,
                             placement=policy_placement(cfg))
    client.start()
    return client


def rollout_worker(cfg: ExperimentConfig, parts: AgentParts, client: Any, *, index: int, prompts: Any,
                   capacity: int, send_control: SendControl,
                   push_group: Callable[[Any], Awaitable[None]], env_client: Any = None,
                   push_settled: Optional[Callable[[Any], Awaitable[None]]] = None) -> Any:
    """Rollout worker `index`, as the run and `arl.evaluate` build it; with `env_client` (env.servers > 0) every
    env instance is a session on an env server (`arl.rollout.env_server.RemoteEnv`)."""
    from arl.api.registry import AGENTS, make_env
    from arl.rollout.env_groups import worker_spec
    from arl.rollout.worker import RolloutWorker

    if env_client is not None:
        from arl.rollout.env_server import RemoteEnv

        def make_env(name: str, **args: Any) -> Any:  # noqa: F811 - the same factory, served remotely
            return RemoteEnv(env_client, name, args)
    rc = cfg.rollout
    agent = AGENTS.get(cfg.agent.name)  # named by the loop watchdog when it blocks the event loop
    eval_concurrency = cfg.eval.concurrency
    if parts.endpoint is not None and parts.endpoint.slots.limit:  # ask the gate for no more than can run at once
        capacity = min(capacity, parts.endpoint.slots.max_groups(parts.group_size) or capacity)
        eval_concurrency = min(eval_concurrency, parts.endpoint.slots.limit)
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
        push_settled=push_settled,
        capacity=capacity,
        trajectory_timeout=rollout_deadlines(cfg)[2],
        eval_concurrency=eval_concurrency,
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
        agent_name=f"'{cfg.agent.name}' ({getattr(agent, '__module__', '?')}.{getattr(agent, '__qualname__', agent)})",
        loop_block_s=rc.loop_block_warn_s,
        learner_wait_s=2 * cfg.startup_timeout,  # a lost learner's restart registers within startup_timeout
    )


async def run_rollout(cfg: ExperimentConfig, ctl: ControlChannel, index: int, run_dir: str) -> RoleParts:
    from arl.rollout.prompts import PromptStream, PromptStreams

    parts = agent_parts(cfg, index)
    addrs = await ctl.request(Lookup(role="rollout", index=index), "addresses", cfg.startup_timeout)
    link = {"push": make_socket(Push).connect(addrs["learner"])}  # replaced when a lost learner is restarted
    # trainable listed policies' learners get every group too (each trains the tokens of its policy)
    policy_pushes = [make_socket(Push).connect(a) for a in addrs.get("policy_learners") or ()]

    async def push_group(group: Any) -> None:
        await link["push"].send("traj", group)
        for push in policy_pushes:
            await push.send("traj", group)
    # stream `s` < rollout.num_workers: worker s's shard; a worker that joined mid-run (or a stream it adopted)
    # draws its own order of every row (`arl.rollout.prompts`)
    prompts = PromptStreams(lambda sid: PromptStream(parts.train_rows, seed=cfg.seed, shard=sid,
                                                     num_shards=cfg.rollout.num_workers), own=index)
    client = inference_client(cfg, [make_socket(Dealer).connect(a) for a in addrs["inference"]])
    for i in addrs.get("retired") or ():  # servers scaled out of the run before this worker started
        await client.worker_lost(int(i))
    env_client = None
    if cfg.env.servers:  # envs as a role: sessions on the env servers, spread by least load
        from arl.rollout.env_server import EnvServerClient

        env_client = EnvServerClient([make_socket(Dealer).connect(a) for a in addrs["env"]],
                                     timeout=cfg.rollout.env_timeout)
        for i in addrs.get("retired_env") or ():  # scaled out of the run before this worker started
            env_client.server_lost(int(i))
        env_client.start()
    judge_client, judge = judge_link(cfg, addrs.get("judge"))
    per_worker = max(1, cfg.rollout.max_concurrent_rollouts // cfg.rollout.num_workers)
    worker = rollout_worker(cfg, parts, client, index=index, prompts=prompts, capacity=per_worker,
                            send_control=ctl.post, push_group=push_group,
                            push_settled=lambda msg: link["push"].send(msg.TYPE, msg.to_payload()),
                            env_client=env_client)

    stats = worker.heartbeat_stats
    if parts.endpoint is not None:  # the endpoint's counters ride on the heartbeat
        server = parts.endpoint
        if server.task_key:  # agents outside the run find this worker's task API here
            await server.start()
            write_task_api_file(run_dir, index, server)
        warn = saturation_watch(f"'{cfg.agent.name}'", server.slots)
        stats = lambda: {**worker.heartbeat_stats(), "endpoint": server.heartbeat_stats(), **warn()}  # noqa: E731
    if judge is not None:  # and the judge's calls, failures by reason and time
        plain = stats
        stats = lambda: {**plain(), "judge": dict(judge.stats)}  # noqa: E731

    async def on_eval(msg: Eval) -> None:
        result = await worker.evaluate(msg.version, msg.max_prompts)
        # fresh counters first (same socket, so they arrive first): the eval record carries this worker's stats as
        # of the evaluation, not a heartbeat up to a second old (a short run can finish within one heartbeat)
        await ctl.post(ctl.beat(stats()))
        await ctl.post(EvalDone.from_payload(result))

    async def on_worker_lost(msg: WorkerLost) -> None:  # the controller dropped an inference server: re-route
        if msg.role == "learner":  # being restarted: finished groups wait for it
            worker.learner_lost()
        elif msg.role == "inference":
            for i in msg.indices:
                await client.worker_lost(i)
        elif msg.role == "env" and env_client is not None:  # its sessions are gone: their groups are dropped
            for i in msg.indices:
                env_client.server_lost(i)
        elif msg.role == "judge" and judge_client is not None:  # its calls go to the others (or time out)
            for i in msg.indices:
                await judge_client.worker_lost(i)

    async def on_worker_back(msg: WorkerBack) -> None:  # the controller restarted an inference server: route to it
        if msg.role == "inference":
            client.worker_back(msg.index, make_socket(Dealer).connect(msg.address))
        elif msg.role == "env" and env_client is not None:
            env_client.server_back(msg.index, make_socket(Dealer).connect(msg.address))
        elif msg.role == "judge" and judge_client is not None:
            judge_client.worker_back(msg.index, make_socket(Dealer).connect(msg.address))

    async def on_worker_draining(msg: WorkerDraining) -> None:  # a server leaves the run: nothing new to it
        logger.info("%s server %d leaves the run: nothing new goes to it", msg.role, msg.index)
        if msg.role == "inference":
            client.worker_draining(msg.index)
        elif msg.role == "env" and env_client is not None:
            env_client.server_draining(msg.index)

    async def on_learner_restarted(msg: LearnerRestarted) -> None:  # back from its checkpoint: push to the new one
        if msg.policy_learner:  # a trainable listed policy's learner: its groups go to the new one, nothing rewinds
            k = msg.policy_learner - 1
            if 0 <= k < len(policy_pushes):
                old, policy_pushes[k] = policy_pushes[k], make_socket(Push).connect(msg.address)
                old.close()
                logger.info("rollout%d: learner%d is back at %s from checkpoint v%d", index, k + 1, msg.address,
                            msg.version)
            return
        old, link["push"] = link["push"], make_socket(Push).connect(msg.address)
        old.close()  # what it still queued for the dead learner goes with it (those groups were lost there)
        worker.rewind_prompts(msg.position)
        worker.learner_back(msg.version)
        logger.info("rollout%d: the learner is back at %s from checkpoint v%d", index, msg.address, msg.version)

    async def on_adopt_streams(msg: AdoptStreams) -> None:  # a worker left the run: its prompts go on here
        try:
            worker.adopt_streams(msg.streams)
        except ValueError as e:
            logger.error("rollout%d: refused to adopt prompt streams %.200r: %s", index, msg.streams, e)

    async def close_push() -> None:
        for push in [link["push"], *policy_pushes]:
            push.close()

    ctl.handlers.update(gate_grant=lambda msg: worker.on_grant(msg.n), eval=on_eval, worker_lost=on_worker_lost,
                        worker_back=on_worker_back, learner_restarted=on_learner_restarted,
                        worker_draining=on_worker_draining, drain=lambda msg: worker.drain(),
                        adopt_streams=on_adopt_streams)
    ack = await ctl.register(cfg.startup_timeout)
    if ack.get("prompt_position"):  # resuming a run or restarted: re-draw what had not settled, then go on
        try:
            worker.rewind_prompts(ack["prompt_position"])
        except ValueError as e:
            raise RuntimeError(f"rollout{index}: the controller sent a bad prompt position: {e}") from None
        logger.info("rollout%d: prompt streams resume: %d prompts drawn again, then positions %s", index,
                    prompts.redraws, prompts.positions())
    logger.info("rollout%d: registered; drawing prompt streams %s", index, prompts.ids)
    closers = [worker.close(), client.close(), close_push()] + ([env_client.close()] if env_client else [])
    if judge_client is not None:
        closers.insert(1, judge_client.close())
    if parts.endpoint is not None:  # it closes after the worker's groups
        closers.insert(1, parts.endpoint.close())
    return [worker.acquire_loop(), ctl.heartbeat(stats)], closers




def judge_link(cfg: ExperimentConfig, addresses: Optional[list[str]]) -> tuple[Any, Any]:
    """(client, judge) for the run's judge workers at `addresses`, the judge installed for this process's judge
    envs (`arl.envs.judge`); (None, None) without judge workers. Its own client: the judge's answers never touch
    the policy client's versions or sticky sessions."""
    if not addresses:
        return None, None
    from transformers import AutoTokenizer

    from arl.envs.judge import Judge, JudgeSettings, install
    from arl.rollout.client import InferenceClient

    jc = cfg.judge
    settings = JudgeSettings(**{f.name: getattr(jc, f.name) for f in dataclasses.fields(JudgeSettings)})
    settings = dataclasses.replace(settings, mode=str(jc.mode))
    # the client's own deadline is later than the judge's `timeout`, so an overrun is named `timeout` by the judge
    # (and aborted at the worker when the judge gives up), not an error answer of the client
    client = InferenceClient([make_socket(Dealer).connect(a) for a in addresses], request_timeout=jc.timeout + 5.0,
                             max_attempts=1)
    client.start()
    judge = Judge(client.generate, AutoTokenizer.from_pretrained(jc.model.path), settings)
    install(judge)
    return client, judge


def construct(cls: Any, **kwargs: Any) -> Any:
    """Pass only the keyword arguments the agent's constructor accepts (user agents need not take them all)."""
    sig = inspect.signature(cls)
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return cls(**kwargs)
    return cls(**{k: v for k, v in kwargs.items() if k in sig.parameters})


