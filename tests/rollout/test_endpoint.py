"""The OpenAI-compatible endpoint driven by the real `openai` client: chat, completions, tools, streaming, n>1,
errors; and the token-exact sessions behind it (continuation and mismatch segments), checked by the token ledger."""

from __future__ import annotations

import asyncio
import gc
import json
import weakref

import aiohttp
import numpy as np
import openai
import pytest
import pytest_asyncio

from arl.api import GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput
from arl.models.tiny import TOOL_CHARS, build_char_tokenizer
from arl.rollout.endpoint import EndpointServer
from arl.rollout.ledger import EngineLog, verify_trajectory

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

TOK = build_char_tokenizer(TOOL_CHARS)
EOS = TOK.eos_token_id
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


def enc(text: str) -> list[int]:
    return list(TOK.encode(text, add_special_tokens=False))


class FakeEngine:
    """Answers each request with the next scripted text (+ eos), sample i of n getting `text + str(i)` when
    n > 1; records requests and responses in an EngineLog (as the rollout worker's queue does)."""

    def __init__(self, *texts: str, version: int = 7) -> None:
        self.texts = list(texts)
        self.requests: list[GenerateRequest] = []
        self.log = EngineLog()
        self.version = version

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        self.requests.append(req)
        await asyncio.sleep(0)
        text = self.texts.pop(0) if self.texts else "ok"
        samples = []
        for i in range(req.gconfig.n):
            ids = enc(text + (str(i) if req.gconfig.n > 1 else "")) + [EOS]
            samples.append(SampleOutput(ids, np.full(len(ids), -0.25, np.float32), [self.version] * len(ids), "stop"))
        resp = GenerateResponse(qid=req.qid, samples=samples)
        self.log.add(req, resp)
        return resp


@pytest_asyncio.fixture
async def server():
    s = EndpointServer(TOK, GenerationConfig(max_new_tokens=32, stop_token_ids=[EOS]), max_context_len=256)
    await s.start()
    yield s
    await s.close()


def client_for(server: EndpointServer, h) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.session_url(h), api_key=server.api_key(h), max_retries=0)


def ledger_ok(trajs, engine: FakeEngine) -> None:
    for t in trajs:
        verify_trajectory(t, engine.log)


async def test_chat_answer_usage_and_versions(server):
    engine = FakeEngine("19")
    h = server.open_session(engine.generate)
    async with client_for(server, h) as c:
        r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "12+7="}])
    assert r.choices[0].message.content == "19" and r.choices[0].finish_reason == "stop"
    prompt = enc("<|user|>12+7=<|assistant|>")
    assert engine.requests[0].input_ids.tolist() == prompt
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 3 and r.usage.total_tokens == len(prompt) + 3
    assert r.choices[0].model_extra["arl"]["versions"] == [7, 7, 7]
    assert r.choices[0].model_extra["arl"]["token_ids"] == enc("19") + [EOS]
    trajs = h.session.trajectories(1.0, "g")
    assert len(trajs) == 1 and trajs[0].input_ids.tolist() == prompt + enc("19") + [EOS]
    assert trajs[0].loss_mask.tolist() == [0] * len(prompt) + [1, 1, 1]
    ledger_ok(trajs, engine)


async def test_multi_turn_continues_the_exact_ids(server):
    """Turn 2's prompt is turn 1's prompt + the generated ids (with eos) + only the new message, templated."""
    engine = FakeEngine("18", "19")
    h = server.open_session(engine.generate)
    messages = [{"role": "user", "content": "12+7="}]
    async with client_for(server, h) as c:
        r1 = await c.chat.completions.create(model="m", messages=messages)
        messages += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Wrong, try again."}]
        await c.chat.completions.create(model="m", messages=messages)
    first = engine.requests[0].input_ids.tolist()
    assert engine.requests[1].input_ids.tolist() == first + enc("18") + [EOS] + enc("<|user|>Wrong, try again.<|assistant|>")
    trajs = h.session.trajectories(0.9, "g")
    assert len(trajs) == 1 and h.session.mismatches == 0 and server.stats["endpoint_prefix_mismatch"] == 0
    assert trajs[0].metadata["turns"] == 2 and trajs[0].metadata["endpoint_prefix_mismatch"] == 0
    assert trajs[0].num_generated == 6
    ledger_ok(trajs, engine)


async def test_rewritten_history_starts_a_new_segment_and_is_counted(server):
    """The agent edits an earlier message: no silent re-tokenisation, a second sequence and a counted mismatch."""
    engine = FakeEngine("18", "19")
    h = server.open_session(engine.generate)
    async with client_for(server, h) as c:
        r1 = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "12+7="}])
        edited = [{"role": "user", "content": "12 + 7 ="}, {"role": "assistant", "content": r1.choices[0].message.content},
                  {"role": "user", "content": "again"}]
        await c.chat.completions.create(model="m", messages=edited)
    assert engine.requests[1].input_ids.tolist() == enc("<|user|>12 + 7 =<|assistant|>18<eos><|user|>again<|assistant|>")
    trajs = h.session.trajectories(1.0, "g")
    assert len(trajs) == 2 and h.session.mismatches == 1 and server.stats["endpoint_prefix_mismatch"] == 1
    assert [t.metadata["endpoint_prefix_mismatch"] for t in trajs] == [0, 1]
    assert trajs[1].num_generated == 3  # the re-rendered "18<eos>" is context in the new segment, not trained
    ledger_ok(trajs, engine)


async def test_a_changed_assistant_answer_is_a_mismatch_too(server):
    engine = FakeEngine("18", "19")
    h = server.open_session(engine.generate)
    async with client_for(server, h) as c:
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}])
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="},
                                                             {"role": "assistant", "content": "2"},
                                                             {"role": "user", "content": "more"}])
    assert h.session.mismatches == 1
    ledger_ok(h.session.trajectories(0.0, "g"), engine)


async def test_tools_are_parsed_into_tool_calls_and_tool_messages_continue_exactly(server):
    engine = FakeEngine(CALL, "5")
    h = server.open_session(engine.generate)
    tools = [{"type": "function", "function": {"name": "calculator", "description": "calc",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "2+3="}]
    async with client_for(server, h) as c:
        r1 = await c.chat.completions.create(model="m", messages=messages, tools=tools)
        m = r1.choices[0].message
        assert r1.choices[0].finish_reason == "tool_calls" and m.content is None
        assert m.tool_calls[0].function.name == "calculator"
        assert json.loads(m.tool_calls[0].function.arguments) == {"expression": "2+3"}
        messages += [m.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "5"}]
        r2 = await c.chat.completions.create(model="m", messages=messages, tools=tools)
    assert r2.choices[0].message.content == "5" and r2.choices[0].finish_reason == "stop"
    first = engine.requests[0].input_ids.tolist()
    assert engine.requests[1].input_ids.tolist() == (first + enc(CALL) + [EOS]
                                                    + enc("<|user|><tool_response>5</tool_response><|assistant|>"))
    trajs = h.session.trajectories(1.0, "g")
    assert len(trajs) == 1 and trajs[0].metadata["tool_calls"] == 1 and server.stats["tool_calls"] == 1
    ledger_ok(trajs, engine)


async def test_a_malformed_tool_call_stays_text(server):
    engine = FakeEngine("<tool_call>{not json}</tool_call>")
    h = server.open_session(engine.generate)
    async with client_for(server, h) as c:
        r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                            tools=[{"type": "function", "function": {"name": "calculator"}}])
    assert r.choices[0].message.content == "<tool_call>{not json}</tool_call>" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


async def test_stream_is_the_whole_answer_as_server_sent_events(server):
    engine = FakeEngine("19", CALL)
    h = server.open_session(engine.generate)
    async with client_for(server, h) as c:
        stream = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "12+7="}],
                                                 stream=True, stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == "19"
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == 3
        stream = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], stream=True,
                                                 tools=[{"type": "function", "function": {"name": "calculator"}}])
        chunks = [ch async for ch in stream]
        calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
        assert calls[0].function.name == "calculator"
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_n_samples_are_choices_and_each_unfollowed_one_is_a_trajectory(server):
    engine = FakeEngine("a", "b")
    h = server.open_session(engine.generate)
    messages = [{"role": "user", "content": "pick"}]
    async with client_for(server, h) as c:
        r = await c.chat.completions.create(model="m", messages=messages, n=3)
        assert [ch.message.content for ch in r.choices] == ["a0", "a1", "a2"]
        assert engine.requests[0].gconfig.n == 3
        messages += [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "go on"}]
        await c.chat.completions.create(model="m", messages=messages)
    assert engine.requests[1].input_ids.tolist()[-len(enc("a1")) - 1 - len(enc("<|user|>go on<|assistant|>")):] == \
        enc("a1") + [EOS] + enc("<|user|>go on<|assistant|>")
    trajs = h.session.trajectories(1.0, "g")
    assert len(trajs) == 3 and h.session.mismatches == 0
    assert sorted(t.metadata["turns"] for t in trajs) == [1, 1, 2]
    ledger_ok(trajs, engine)


async def test_sampling_fields_are_mapped(server):
    engine = FakeEngine("x", "y")
    h = server.open_session(engine.generate)
    async with client_for(server, h) as c:
        r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], temperature=0.5,
                                            top_p=0.9, max_completion_tokens=5, stop=["!"], logprobs=True)
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q2"}], temperature=0,
                                        max_tokens=7)
    g0, g1 = engine.requests[0].gconfig, engine.requests[1].gconfig
    assert (g0.temperature, g0.top_p, g0.max_new_tokens, g0.greedy) == (0.5, 0.9, 5, False)
    assert set(g0.stop_token_ids) == {EOS, enc("!")[0]}
    assert g1.greedy and g1.max_new_tokens == 7
    lp = r.choices[0].logprobs.content
    assert [t.logprob for t in lp] == [-0.25, -0.25] and lp[0].token == "x"


async def test_bad_requests_get_openai_errors_naming_the_field(server):
    engine = FakeEngine()
    h = server.open_session(engine.generate)
    msgs = [{"role": "user", "content": "q"}]
    async with client_for(server, h) as c:
        for kw, field in [({"logit_bias": {"1": 2}}, "logit_bias"), ({"seed": 3}, "seed"), ({"n": 0}, "n"),
                          ({"temperature": 5}, "temperature"), ({"stop": "two"}, "stop"),
                          ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
                          ({"tool_choice": "required"}, "tool_choice")]:
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="m", messages=msgs, **kw)
            assert e.value.body["param"] == field and e.value.body["type"] == "invalid_request_error", kw
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q" * 250}], max_tokens=10)
        assert e.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "q"}])
        assert e.value.body["param"] == "messages"
    async with aiohttp.ClientSession() as http:
        async with http.post(server.session_url(h) + "/chat/completions", data=b"{nope",
                             headers={"Authorization": f"Bearer {server.api_key(h)}"}) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["type"] == "invalid_request_error"
    assert engine.requests == []  # nothing bad reached the engine


async def test_unknown_and_ended_sessions_are_404_and_late_calls_counted(server):
    engine = FakeEngine()
    h = server.open_session(engine.generate)
    bad = openai.AsyncOpenAI(base_url=server.url + "/sessions/nope/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    await bad.close()
    server.end_session(h.key)
    async with client_for(server, h) as c:
        with pytest.raises(openai.NotFoundError) as e:
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    assert e.value.code == "session_ended" and h.late_calls == 1 and server.stats["late_calls"] == 1


async def test_ended_sessions_keep_no_handle_but_late_calls_are_still_404_and_counted(server):
    """An ended session keeps only what counting its late calls needs: its handle (every turn's ids, the samples,
    and through `generate` the group's client) is freed once the agent lets go of it."""
    engine = FakeEngine(*["ok"] * 4)
    refs, ended = [], []
    for _ in range(4):
        h = server.open_session(engine.generate)
        async with client_for(server, h) as c:
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        server.end_session(h.key)
        refs += [weakref.ref(h), weakref.ref(h.session), weakref.ref(h.session.turns[0])]
        ended.append((server.session_url(h), server.api_key(h)))
        del h, c
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    for url, key in ended:
        async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as c:
            with pytest.raises(openai.NotFoundError) as e:
                await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        assert e.value.code == "session_ended"
    assert server.stats["late_calls"] == 4 and len(engine.requests) == 4


async def test_bearer_token_alone_names_the_session_and_models(server):
    """The session's token names its session without the path (OPENAI_BASE_URL=<server>/v1, OPENAI_API_KEY=<token>)."""
    engine = FakeEngine("hi")
    h = server.open_session(engine.generate)
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key(h), max_retries=0) as c:
        r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        assert r.choices[0].message.content == "hi"
        models = await c.models.list()
        assert [m.id for m in models.data] == ["arl-policy"]


async def test_a_session_token_opens_only_its_own_session_until_it_ends(server):
    engine = FakeEngine("a", "b", "c")
    h1, h2 = server.open_session(engine.generate), server.open_session(engine.generate)
    t1, t2 = server.api_key(h1), server.api_key(h2)
    assert t1 != t2 and len(t1) > 60 and h1.key not in (t1.partition(".")[2], t2.partition(".")[2])
    assert h1.token not in repr(h1)  # not in a log line that prints the handle
    msgs = [{"role": "user", "content": "q"}]

    async def ask(url: str, key: str):
        async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as c:
            return await c.chat.completions.create(model="m", messages=msgs)

    assert (await ask(server.session_url(h1), t1)).choices[0].message.content == "a"
    for url, key in [(server.session_url(h2), t1),  # another session's token
                     (server.session_url(h2), h2.key),  # the session key alone (it is no secret: trajectories carry it)
                     (server.session_url(h2), t2.partition(".")[0] + "." + t1.partition(".")[2]),  # spliced
                     (server.session_url(h2), "sk-" + "x" * 40)]:
        with pytest.raises(openai.AuthenticationError) as e:
            await ask(url, key)
        assert e.value.body["type"] == "invalid_request_error" and e.value.code == "invalid_api_key", key
    async with aiohttp.ClientSession() as http:  # no API key at all
        async with http.post(server.session_url(h2) + "/chat/completions", json={"messages": msgs}) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    assert len(engine.requests) == 1 and server.stats["refused_auth"] == 5
    assert (await ask(server.url + "/v1", t2)).choices[0].message.content == "b"  # t2 still opens h2
    server.end_session(h1.key)
    for url in (server.session_url(h1), server.url + "/v1"):
        with pytest.raises(openai.NotFoundError) as e:
            await ask(url, t1)
        assert e.value.code == "session_ended"
    assert server.stats["late_calls"] == 2 and len(engine.requests) == 2


async def test_the_endpoint_knows_no_run_secret():
    """The run's secret authenticates ZMQ frames; the endpoint neither takes it nor accepts it as a key."""
    import inspect

    assert "secret" not in inspect.signature(EndpointServer).parameters
    s = EndpointServer(TOK, GenerationConfig(max_new_tokens=8, stop_token_ids=[EOS]), 256)
    await s.start()
    try:
        h = s.open_session(FakeEngine("ok").generate)
        async with openai.AsyncOpenAI(base_url=s.session_url(h), api_key="s" * 20, max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        async with openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                await c.models.list()
        async with openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=s.api_key(h), max_retries=0) as c:
            assert [m.id for m in (await c.models.list()).data] == ["arl-policy"]
        assert s.openai_client().api_key not in (s.api_key(h), h.key)  # the shared client opens nothing itself
    finally:
        await s.close()


async def test_completions_text_and_ids_continue_exactly(server):
    engine = FakeEngine("19", "!", "x")
    h = server.open_session(engine.generate)
    async with client_for(server, h) as c:
        r1 = await c.completions.create(model="m", prompt="12+7=")
        assert r1.choices[0].text == "19" and r1.usage.prompt_tokens == 5
        await c.completions.create(model="m", prompt="12+7=" + r1.choices[0].text + " ok?", logprobs=0)
        r3 = await c.completions.create(model="m", prompt=[5, 6, 7], stream=True)
        chunks = [ch async for ch in r3]
        assert chunks[0].choices[0].text == "x"
    assert engine.requests[1].input_ids.tolist() == enc("12+7=") + enc("19") + [EOS] + enc(" ok?")
    trajs = h.session.trajectories(1.0, "g")
    assert len(trajs) == 2 and h.session.mismatches == 1  # the id prompt continued nothing: its own segment
    ledger_ok(trajs, engine)


async def test_a_caller_that_hangs_up_cancels_its_generation(server):
    """The HTTP client gives up (its timeout, or its agent's deadline cancelled it): the handler is cancelled, so
    the inference client aborts the request instead of generating for nobody (and booking a late call)."""
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def hang(req):
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    h = server.open_session(hang)
    async with openai.AsyncOpenAI(base_url=server.session_url(h), api_key=server.api_key(h), max_retries=0,
                                  timeout=1.0) as c:
        with pytest.raises(openai.APITimeoutError):
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    assert started.is_set()
    await asyncio.wait_for(cancelled.wait(), 10)
    server.end_session(h.key)
    assert h.late_calls == 0


async def test_the_model_field_selects_a_named_policy_and_its_turns_are_recorded_as_its():
    """A run serving a frozen `opponent` beside its own policy: `model` picks who answers, the trajectory says who
    generated which turn (the run's learner trains only its own), an unknown model is a 404 in OpenAI's shape, and
    without named policies any model name is the run's own."""
    s = EndpointServer(TOK, GenerationConfig(max_new_tokens=32, stop_token_ids=[EOS]), max_context_len=256,
                       model_name="arl-policy", policies=["opponent"])
    await s.start()
    try:
        engine = FakeEngine("a", "b", "c")
        h = s.open_session(engine.generate)
        msgs = [{"role": "user", "content": "go"}]
        async with client_for(s, h) as c:
            await c.chat.completions.create(model="arl-policy", messages=msgs)
            msgs += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "and?"}]
            await c.chat.completions.create(model="opponent", messages=msgs)
            msgs += [{"role": "assistant", "content": "b"}, {"role": "user", "content": "more"}]
            await c.completions.create(model="opponent", prompt="x", max_tokens=3)  # completions too
            with pytest.raises(openai.NotFoundError) as e:
                await c.chat.completions.create(model="gpt-4o", messages=msgs)
            assert [m.id for m in (await c.models.list()).data] == ["arl-policy", "opponent"]
        assert e.value.code == "model_not_found" and e.value.body["param"] == "model" and "opponent" in str(e.value)
        assert [r.policy for r in engine.requests] == [None, "opponent", "opponent"]  # the 404 reached no engine
        chat = max(h.session.trajectories(1.0, "g"), key=lambda t: t.metadata["turns"])
        (name, start, end), = chat.policy_spans
        assert name == "opponent" and chat.input_ids[start:end].tolist() == enc("b") + [EOS]
        assert chat.owned_by(None).sum() == len(enc("a")) + 1  # the run's own turn: its learner's tokens
        ledger_ok(h.session.trajectories(1.0, "g"), engine)
    finally:
        await s.close()


async def test_without_named_policies_any_model_name_is_the_runs_own(server):
    engine = FakeEngine("x")
    h = server.open_session(engine.generate)
    async with client_for(server, h) as c:
        await c.chat.completions.create(model="whatever-my-framework-sends", messages=[{"role": "user", "content": "q"}])
    assert engine.requests[0].policy is None and h.session.trajectories(1.0, "g")[0].policy_spans == []
