"""Hostile input to the OpenAI-compatible endpoint: every bad body is a 4xx OpenAI error naming what is wrong, never
a 500 (the engine behind it refuses like the real ones do, so a 500 here is the endpoint's own bug), the server
goes on serving, and what it keeps per session stays bounded."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import random
import tracemalloc
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio

from arl.api import GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput
from arl.inference.requests import check_request, refusal
from arl.models.tiny import TOOL_CHARS, build_char_tokenizer
from arl.rollout.endpoint import EndpointServer

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

TOK = build_char_tokenizer(TOOL_CHARS)
EOS = TOK.eos_token_id
VOCAB = len(TOK)
MAX_CONTEXT = 256


class CheckingEngine:
    """Refuses what the real engines refuse (`check_request`, with the model's vocabulary and context window) and
    answers anything else with a short text: an endpoint that lets bad input through gets a 500 from it."""

    def __init__(self) -> None:
        self.refused: list[str] = []
        self.served = 0

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        await asyncio.sleep(0)
        err = check_request(req, max_context_len=MAX_CONTEXT, vocab_size=VOCAB)
        if err is not None:
            self.refused.append(err)
            return refusal(req, err)
        self.served += 1
        ids = list(TOK.encode("ok", add_special_tokens=False)) + [EOS]
        return GenerateResponse(qid=req.qid, samples=[
            SampleOutput(ids, np.full(len(ids), -0.5, np.float32), [1] * len(ids), "stop")
            for _ in range(req.gconfig.n)])


@pytest_asyncio.fixture
async def server():
    s = EndpointServer(TOK, GenerationConfig(max_new_tokens=8, stop_token_ids=[EOS]), max_context_len=MAX_CONTEXT,
                       vocab_size=VOCAB)
    await s.start()
    yield s
    await s.close()


async def post(http: aiohttp.ClientSession, url: str, data: bytes, key: str) -> tuple[int, Any]:
    """POST `data` with the session's token `key` as the API key."""
    async with http.post(url, data=data, headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {key}"}) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


def deep(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


# -- the findings, one by one ----------------------------------------------------------------------------------------
async def test_completion_ids_beyond_int32_or_the_vocabulary_are_400_naming_prompt(server):
    engine = CheckingEngine()
    h = server.open_session(engine.generate)
    url = server.session_url(h) + "/completions"
    async with aiohttp.ClientSession() as http:
        for ids in ([5, 2 ** 31], [2 ** 63 + 1], [VOCAB], [5, VOCAB + 1000]):
            status, body = await post(http, url, json.dumps({"prompt": ids}).encode(), server.api_key(h))
            assert status == 400, (ids, status, body)
            assert body["error"]["param"] == "prompt" and body["error"]["type"] == "invalid_request_error"
            assert str(VOCAB) in body["error"]["message"]
        status, body = await post(http, url, json.dumps({"prompt": [5, VOCAB - 1]}).encode(), server.api_key(h))
        assert status == 200, body
    assert engine.refused == []  # nothing bad reached the engine


@pytest.mark.parametrize("depth", [2_000, 100_000])
async def test_deeply_nested_json_is_400_not_500(server, depth):
    engine = CheckingEngine()
    h = server.open_session(engine.generate)
    async with aiohttp.ClientSession() as http:
        for path, doc in [("/chat/completions", '{"messages": ' + deep(depth) + "}"),
                          ("/completions", '{"prompt": "a", "metadata": ' + deep(depth, '{"a": ', "}")[:-depth]
                           + "1" + "}" * depth + "}"),
                          ("/completions", deep(depth))]:
            status, body = await post(http, server.session_url(h) + path, doc.encode(), server.api_key(h))
            assert status == 400, (path, status, str(body)[:200])
            assert body["error"]["type"] == "invalid_request_error"
        status, body = await post(http, server.session_url(h) + "/completions", b'{"prompt": "1+1="}',
                                  server.api_key(h))
        assert status == 200, body


# -- the fuzz ---------------------------------------------------------------------------------------------------------
HOSTILE = [None, True, False, 0, -1, 1, 2, 64, 65, 2 ** 31, 2 ** 63, 10 ** 30, -(2 ** 63), 0.5, -0.0, 1e308,
           math.inf, -math.inf, math.nan, "", "x", "\u0000", "\ud7ff\uffff", "1" * 5000, [], [1], [[1]], ["a"],
           {}, {"a": 1}, {"type": "text"}, [None], [{}], list(range(300))]


def hostile(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth < 3 and r < 0.15:
        return [hostile(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if depth < 3 and r < 0.25:
        return {rng.choice(["role", "content", "type", "text", "function", "name", "arguments", "x"]):
                hostile(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return rng.choice(HOSTILE)


def message(rng: random.Random) -> Any:
    m: dict[str, Any] = {"role": rng.choice(["user", "assistant", "system", "tool", "wizard", 3, None]),
                         "content": rng.choice(["1+1=", "", None, [{"type": "text", "text": "hi"}], hostile(rng)])}
    if rng.random() < 0.2:
        m["tool_calls"] = rng.choice([hostile(rng), [{"function": {"name": "f", "arguments": hostile(rng)}}],
                                      [{"id": 1, "function": hostile(rng)}]])
    return m if rng.random() < 0.9 else hostile(rng)


CHAT = ["messages", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "max_tokens",
        "max_completion_tokens", "stop", "n", "seed", "logprobs", "top_logprobs", "stream", "stream_options",
        "frequency_penalty", "presence_penalty", "response_format", "model", "user", "metadata", "logit_bias"]
COMPLETION = ["prompt", "temperature", "top_p", "max_tokens", "stop", "n", "seed", "logprobs", "stream", "echo",
              "best_of", "suffix", "model", "stream_options"]


def body(rng: random.Random, chat: bool) -> bytes:
    """One request body: mostly a plausible request with a few hostile fields, sometimes anything at all."""
    r = rng.random()
    if r < 0.04:
        return rng.randbytes(rng.randint(0, 64))
    if r < 0.08:
        return deep(rng.choice([10, 900, 5000, 50_000]), *rng.choice([("[", "]"), ("{\"a\":", "}")])).encode()
    if r < 0.12:
        return json.dumps(hostile(rng)).encode()
    b: dict[str, Any] = ({"messages": [{"role": "user", "content": "1+1="}]} if chat else {"prompt": "1+1="})
    for name in rng.sample(CHAT if chat else COMPLETION, rng.randint(0, 4)):
        b[name] = hostile(rng)
    if chat and rng.random() < 0.5:
        b["messages"] = [message(rng) for _ in range(rng.randint(0, 4))]
    if not chat and rng.random() < 0.5:
        b["prompt"] = rng.choice([[rng.choice([0, 5, VOCAB - 1, VOCAB, 2 ** 31, 2 ** 64, -1, True, 1.5, "a"])
                                   for _ in range(rng.randint(1, 5))],
                                  [list(range(5, 20))], [[5, 6], [7]], "x" * rng.randint(0, 400), hostile(rng)])
    if rng.random() < 0.1:
        b[rng.choice(["n", "max_tokens", "max_completion_tokens"])] = rng.choice([64, 10 ** 6, 2 ** 40, 1 << 30])
    if rng.random() < 0.05:
        b["unknown_" + str(rng.randint(0, 9))] = 1
    return json.dumps(b, allow_nan=True).encode()


async def fuzz_round(server: EndpointServer, http: aiohttp.ClientSession, rng: random.Random, engine: CheckingEngine,
                     sessions: int, requests: int) -> dict[int, int]:
    """`sessions` sessions opened, `requests` random bodies sent over them (a few to unknown sessions), every
    session ended; returns the count per status."""
    handles = [server.open_session(engine.generate, greedy=rng.random() < 0.2) for _ in range(sessions)]
    statuses: dict[int, int] = {}
    for i in range(requests):
        h = rng.choice(handles)
        chat = rng.random() < 0.6
        base = server.session_url(h) if rng.random() < 0.95 else server.url + "/sessions/" + "f" * 24 + "/v1"
        status, answer = await post(http, base + ("/chat/completions" if chat else "/completions"), body(rng, chat),
                                    server.api_key(h))
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (200, 400, 404), (i, status, str(answer)[:300])
        if status != 200:
            assert isinstance(answer, dict) and answer["error"]["type"] == "invalid_request_error", answer
    for h in handles:
        server.end_session(h.key)
    return statuses


async def test_fuzzed_bodies_never_get_a_500_and_the_server_goes_on_bounded():
    engine = CheckingEngine()
    s = EndpointServer(TOK, GenerationConfig(max_new_tokens=8, stop_token_ids=[EOS]), max_context_len=MAX_CONTEXT,
                       vocab_size=VOCAB, max_ended=200)
    await s.start()
    rng = random.Random(20240611)
    try:
        async with aiohttp.ClientSession() as http:
            first = await fuzz_round(s, http, rng, engine, sessions=1000, requests=400)
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                second = await fuzz_round(s, http, rng, engine, sessions=1000, requests=400)
                gc.collect()
                grown = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
            # a normal request still works after all of it
            h = s.open_session(engine.generate)
            status, answer = await post(http, s.session_url(h) + "/chat/completions",
                                        json.dumps({"messages": [{"role": "user", "content": "1+1="}]}).encode(),
                                        s.api_key(h))
            assert status == 200 and answer["choices"][0]["message"]["content"] == "ok", answer
            s.end_session(h.key)
    finally:
        await s.close()
    assert engine.refused == []  # every bad request was answered by the endpoint, none by an engine fault
    for statuses in (first, second):  # the fuzz reached the engine and the refusals both
        assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 100, statuses
    assert engine.served > 40
    assert len(s.sessions) == 0  # every session ended; the ended ones are kept up to max_ended
    # a second round of 1000 sessions and 400 hostile requests leaves (almost) nothing behind: the ended sessions
    # are capped, counters are a fixed set of names
    assert grown < 4 * 1024 * 1024, grown
