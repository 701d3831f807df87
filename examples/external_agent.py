"""An agent outside the run, in Python: it takes episodes from a running `agent.name=external` run's task API,
answers each through its own session with the OpenAI SDK (the default math agent: up to 3 turns, "Wrong, try
again." after a wrong answer), and gives the reward back. Start the run, then this in another terminal:

    python training/main_async_ppo.py agent.name=external run_name=ext
    python examples/external_agent.py runs/ext                  # --concurrency 32, --episodes N to stop after N

It reads `<run_dir>/task_api/rollout<i>.json` (each rollout worker's address and the task key) and spreads its
requests over the workers. Nothing here is ARL's code: any program that speaks HTTP can do the same (see
examples/node/agent.mjs); it exits when the run has ended.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import itertools
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import openai


def workers(run_dir: str, wait_s: float = 300.0) -> list[dict]:
    """The task API files of the run's rollout workers (waiting for the first to appear)."""
    deadline = time.monotonic() + wait_s
    while True:
        files = sorted(glob.glob(os.path.join(run_dir, "task_api", "rollout*.json")))
        if files:
            out = []
            for path in files:
                with open(path) as f:
                    out.append(json.load(f))
            return out
        if time.monotonic() > deadline:
            raise SystemExit(f"no task API under {run_dir}/task_api after {wait_s:g}s: is the run using "
                             "agent.name=external?")
        time.sleep(0.5)


def post(worker: dict, path: str, body: dict, timeout: float = 90.0) -> tuple[int, Optional[dict]]:
    req = urllib.request.Request(worker["episodes"] + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {worker['key']}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, (json.load(r) if r.status == 200 else None)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


async def solve(shared: openai.AsyncOpenAI, ep: dict) -> float:
    """The default math agent over the episode's session; the reward is computed here from the row's answer. The
    session's client is a copy of one shared client (`with_options`): a new `AsyncOpenAI` per episode builds an
    HTTP client and an SSL context each time (~50 ms of CPU), which made this program the run's bottleneck."""
    client = shared.with_options(base_url=ep["base_url"], api_key=ep["api_key"])
    messages = [{"role": "user", "content": ep["prompt"]["prompt"]}]
    for turn in range(3):
        reply = await client.chat.completions.create(model=ep["model"], messages=messages)
        answer = (reply.choices[0].message.content or "").strip()
        if answer == str(ep["prompt"].get("answer")):
            return 0.9 ** turn
        if reply.choices[0].finish_reason != "stop":
            break
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Wrong, try again."}]
    return 0.0


async def loop(shared: openai.AsyncOpenAI, pool: Any, done: list[int], limit: int) -> None:
    failures = 0
    while not limit or done[0] < limit:
        worker = next(pool)
        try:
            status, ep = await asyncio.to_thread(post, worker, "", {"wait_s": 20})
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            failures += 1
            if failures >= 10:  # the run has ended (or its workers are unreachable)
                return
            await asyncio.sleep(1.0)
            continue
        failures = 0
        if status != 200 or ep is None:
            continue
        try:
            reward: Optional[float] = await solve(shared, ep)
        except openai.APIError:  # the group ended under us (its deadline): nothing to give back
            continue
        await asyncio.to_thread(post, worker, f"/{ep['episode_id']}/reward", {"reward": reward})
        done[0] += 1


async def main(args: argparse.Namespace) -> None:
    # a thread per loop for its long-poll and one more for its reward (the default pool has cpu + 4 threads: the
    # rewards would queue behind other loops' long-polls, and the run would wait on them)
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2 * args.concurrency + 2))
    pool = itertools.cycle(workers(args.run_dir))
    done = [0]
    async with openai.AsyncOpenAI(api_key="per-episode", max_retries=0, timeout=120.0) as shared:
        await asyncio.gather(*(loop(shared, pool, done, args.episodes) for _ in range(args.concurrency)))
    print(f"{done[0]} episodes rewarded")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--concurrency", type=int, default=32, help="episodes worked on at once")
    p.add_argument("--episodes", type=int, default=0, help="stop after this many (0: until the run ends)")
    asyncio.run(main(p.parse_args()))
