"""Benchmark of the endpoint: round trips per second and latency per call of an agent written against
`openai.AsyncOpenAI` (through the rollout worker's endpoint) vs the same agent over the obs/act queues, on the same
engine, the same load, in one run; and the same agent in each dialect: chat completions over the in-process path
(the clients the worker hands its agents: no socket) and over the socket (what a subprocess or external agent
uses), the Responses API and Anthropic's Messages API (in process).

Both agents run `--groups` groups of `--group-size` chats at once, `--turns` turns each (a fixed user message
after every answer), every reply exactly `--reply-tokens` tokens (EOS disabled), all through `run_agent` as the
rollout worker runs them, on one in-process `TorchEngine` with the tiny model. Rounds alternate queue / endpoint
(`--rounds` each) so both see the same machine load; CPU time per call (this process: agent, endpoint, client,
engine) is printed beside wall time because a shared machine makes wall time noisy.

Usage: python scripts/bench_endpoint.py [--groups 8 --group-size 8 --turns 3 --reply-tokens 16 --rounds 2]
The last lines are `endpoint: NN% of queue throughput` (chat, in process) and one per other path:
`endpoint (socket|responses|messages): NN% of queue throughput`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl.agents.common import generate  # noqa: E402
from arl.api import Agent, GenerateRequest, GenerationConfig, TrajectoryBuilder  # noqa: E402
from arl.inference.torch_engine import TorchEngine  # noqa: E402
from arl.models.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from arl.rollout.endpoint import EndpointServer  # noqa: E402
from arl.rollout.openai_agent import EndpointAgent  # noqa: E402
from arl.rollout.worker import run_agent  # noqa: E402

PROMPT = "12+7="
FEEDBACK = "Wrong, try again."


class EngineClient:
    """The inference client's interface over an in-process engine (no sockets on either path)."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine

    async def generate(self, req: GenerateRequest, info: Any = None) -> Any:
        return await self.engine.agenerate(req)


class QueueAgent(Agent):
    """The multi-turn chat written over the queues (token ids, as the built-in agents are)."""

    def __init__(self, tok: Any, g: GenerationConfig, group_size: int, turns: int, latencies: list[float]) -> None:
        self.tok, self.g, self.group_size, self.turns, self.lat = tok, g, group_size, turns, latencies
        self.prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                              add_generation_prompt=True)
        self.feedback = tok.encode(f"<|user|>{FEEDBACK}<|assistant|>", add_special_tokens=False)

    async def _chain(self, i: int, obs: Any, act: Any) -> Any:
        b = TrajectoryBuilder(self.tok.encode(self.prompt, add_special_tokens=False))
        for t in range(self.turns):
            t0 = time.perf_counter()
            resp = await generate(obs, act, GenerateRequest(f"c{i}t{t}", b.input_ids, self.g, session_id=f"s{i}"))
            self.lat.append(time.perf_counter() - t0)
            b.add_generated(resp.samples[0])
            if t < self.turns - 1:
                b.add_context(self.feedback, source="feedback")
        return b.build(reward=0.0, group_id="g")

    async def collect_trajectory(self, prompt: dict, env: Any, obs_queue: Any, act_queue: Any) -> list:
        return list(await asyncio.gather(*(self._chain(i, obs_queue, act_queue) for i in range(self.group_size))))


def endpoint_agent_fn(turns: int, reply_tokens: int, latencies: list[float]) -> Any:
    async def agent(client: Any, prompt: dict) -> float:
        messages = [{"role": "user", "content": PROMPT}]
        for t in range(turns):
            t0 = time.perf_counter()
            r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=reply_tokens)
            latencies.append(time.perf_counter() - t0)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": FEEDBACK}]
        return 0.0
    return agent


def responses_agent_fn(turns: int, reply_tokens: int, latencies: list[float]) -> Any:
    async def agent(client: Any, prompt: dict) -> float:
        items: list[dict] = [{"role": "user", "content": PROMPT}]
        for t in range(turns):
            t0 = time.perf_counter()
            r = await client.responses.create(model="policy", input=items, max_output_tokens=reply_tokens)
            latencies.append(time.perf_counter() - t0)
            items += [{"role": "assistant", "content": r.output_text}, {"role": "user", "content": FEEDBACK}]
        return 0.0
    return agent


def messages_agent_fn(turns: int, reply_tokens: int, latencies: list[float]) -> Any:
    async def agent(anthropic: Any, prompt: dict) -> float:
        messages = [{"role": "user", "content": PROMPT}]
        for t in range(turns):
            t0 = time.perf_counter()
            r = await anthropic.messages.create(model="policy", messages=messages, max_tokens=reply_tokens)
            latencies.append(time.perf_counter() - t0)
            messages += [{"role": "assistant", "content": r.content[0].text}, {"role": "user", "content": FEEDBACK}]
        return 0.0
    return agent


async def one_round(make_agent: Any, client: EngineClient, groups: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, trajectories) of `groups` groups run at once."""
    w0, c0 = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*(run_agent(make_agent(), {"id": str(i)}, None, client, 600.0)  # type: ignore[arg-type]
                                     for i in range(groups)))
    return time.perf_counter() - w0, time.process_time() - c0, sum(len(r) for r in results)


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), max_position_embeddings=512)
    engine = TorchEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=None,
                         max_batch_size=args.groups * args.group_size, max_context_len=512)
    engine.start()
    client = EngineClient(engine)
    g = GenerationConfig(max_new_tokens=args.reply_tokens, min_new_tokens=args.reply_tokens)
    server = EndpointServer(tok, g, max_context_len=512)
    socket_server = EndpointServer(tok, g, max_context_len=512, in_process=False)
    await server.start()
    await socket_server.start()
    calls = args.groups * args.group_size * args.turns
    lats: dict[str, list[float]] = {}
    makers: dict[str, Any] = {}

    def add(name: str, make: Any) -> None:
        lats[name] = []
        makers[name] = lambda: make(lats[name])

    add("queue", lambda lat: QueueAgent(tok, g, args.group_size, args.turns, lat))
    add("endpoint", lambda lat: EndpointAgent(endpoint_agent_fn(args.turns, args.reply_tokens, lat), server,
                                              args.group_size))
    add("endpoint (socket)", lambda lat: EndpointAgent(endpoint_agent_fn(args.turns, args.reply_tokens, lat),
                                                       socket_server, args.group_size))
    add("endpoint (responses)", lambda lat: EndpointAgent(responses_agent_fn(args.turns, args.reply_tokens, lat),
                                                          server, args.group_size))
    add("endpoint (messages)", lambda lat: EndpointAgent(messages_agent_fn(args.turns, args.reply_tokens, lat),
                                                         server, args.group_size))
    results: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": [], "lat": []} for k in makers}
    for make in makers.values():  # warm every path (imports, the SDK clients, the engine)
        await one_round(make, client, 2)
    names = list(makers)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # each path takes each slot in turn
        for name in order:
            lats[name].clear()
            wall, cpu, n = await one_round(makers[name], client, args.groups)
            assert n == args.groups * args.group_size, (name, n)
            results[name]["wall"].append(wall)
            results[name]["cpu"].append(cpu)
            results[name]["lat"].append(statistics.median(lats[name]))
    await server.close()
    await socket_server.close()
    await engine.close()
    print(f"{args.groups} groups x {args.group_size} chats x {args.turns} turns = {calls} calls per round, "
          f"{args.reply_tokens}-token replies, {args.rounds} rounds each (rotating), one in-process torch engine")
    rate = {}
    for name, r in results.items():
        wall, cpu = statistics.median(r["wall"]), statistics.median(r["cpu"])
        rate[name] = calls / wall
        print(f"{name:>21}: {rate[name]:8.1f} round trips/s   p50 latency {statistics.median(r['lat']) * 1000:7.1f} ms"
              f"   CPU {cpu / calls * 1000:6.2f} ms per call")
    for name in names[1:]:
        print(f"{name}: {100 * rate[name] / rate['queue']:.0f}% of queue throughput")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(p.parse_args()))
