"""The Responses and Anthropic Messages dialects of the endpoint, driven by the real `openai` and `anthropic` SDKs
(and the OpenAI Agents SDK on its default Responses model): plain answers, tools, streams, errors in each
dialect's shape, and continuation that is token-exact by the token ledger."""

from __future__ import annotations

import json

import aiohttp
import anthropic
import openai
import pytest

from arl.rollout.ledger import verify_trajectory
from tests.rollout.test_endpoint import CALL, EOS, FakeEngine, client_for, enc, server  # noqa: F401 - fixture

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

TOOL_RESULT = "<|user|><tool_response>5</tool_response><|assistant|>"
FN_TOOL = {"type": "function", "name": "calculator", "description": "calc",
           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}
CLAUDE_TOOL = {"name": "calculator", "description": "calc",
               "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}}}


def claude_for(server, h) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.session_root(h), api_key=server.api_key(h), max_retries=0)


def exact(h, engine, turns: int) -> None:
    trajs = h.session.trajectories(1.0, "g")
    assert len(trajs) == 1 and h.session.mismatches == 0 and trajs[0].metadata["turns"] == turns
    for t in trajs:
        verify_trajectory(t, engine.log)


# -- Responses ---------------------------------------------------------------------------------------------------
async def test_responses_plain_with_instructions(server):
    engine = FakeEngine("19")
    h = server.open_session(engine.generate)
    async with client_for(server, h) as c:
        r = await c.responses.create(model="m", input="12+7=", instructions="Add. ")
    assert r.status == "completed" and r.output_text == "19"
    assert engine.requests[0].input_ids.tolist() == enc("Add. <|user|>12+7=<|assistant|>")
    assert r.usage.output_tokens == 3 and r.usage.input_tokens == len(engine.requests[0].input_ids)
    assert r.model_extra["arl"]["versions"] == [7, 7, 7]
    exact(h, engine, 1)


async def test_responses_tool_call_continues_exactly_by_items_and_by_previous_response_id(server):
    for by_id in (False, True):
        engine = FakeEngine(CALL, "5")
        h = server.open_session(engine.generate)
        async with client_for(server, h) as c:
            r1 = await c.responses.create(model="m", input="2+3=", tools=[FN_TOOL])
            (call,) = r1.output
            assert call.type == "function_call" and call.name == "calculator"
            assert json.loads(call.arguments) == {"expression": "2+3"}
            result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
            if by_id:
                r2 = await c.responses.create(model="m", previous_response_id=r1.id, input=[result], tools=[FN_TOOL])
            else:
                items = [{"role": "user", "content": "2+3="}, *[o.model_dump(exclude_none=True) for o in r1.output],
                         result]
                r2 = await c.responses.create(model="m", input=items, tools=[FN_TOOL])
        assert r2.output_text == "5"
        first = engine.requests[0].input_ids.tolist()
        assert engine.requests[1].input_ids.tolist() == first + enc(CALL) + [EOS] + enc(TOOL_RESULT)
        exact(h, engine, 2)


async def test_responses_stream_is_the_event_sequence_the_sdk_accumulates(server):
    engine = FakeEngine("19", CALL)
    h = server.open_session(engine.generate)
    async with client_for(server, h) as c:
        async with c.responses.stream(model="m", input="12+7=") as s:
            kinds = [e.type async for e in s]
            final = await s.get_final_response()
        assert final.output_text == "19" and kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "response.output_text.delta" in kinds
        stream = await c.responses.create(model="m", input="q", tools=[FN_TOOL], stream=True)
        events = [e async for e in stream]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"expression": "2+3"} and events[-1].response.output[0].name == "calculator"
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_responses_refusals_and_length(server):
    engine = FakeEngine("19", "x" * 40)
    h = server.open_session(engine.generate)
    async with client_for(server, h) as c:
        for kw, param in [({"tools": [{"type": "web_search"}]}, "tools"), ({"tool_choice": "required"}, "tool_choice"),
                          ({"previous_response_id": "resp_nope"}, "previous_response_id"),
                          ({"max_output_tokens": 10_000}, "max_output_tokens"), ({"background": True}, "background"),
                          ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
                          ({"include": ["file_search_call.results"]}, "include")]:
            with pytest.raises(openai.BadRequestError) as e:
                await c.responses.create(**({"model": "m", "input": "q"} | kw))
            assert e.value.body["param"] == param, (kw, e.value.body)
        r = await c.responses.create(model="m", input="q", max_output_tokens=2)
        assert r.status == "completed"  # the fake engine answers its script; the field was honoured below
        assert engine.requests[-1].gconfig.max_new_tokens == 2
    async with openai.AsyncOpenAI(base_url=server.session_url(h), api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.responses.create(model="m", input="q")


async def test_the_agents_sdk_on_its_default_responses_model_continues_exactly(server):
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    engine = FakeEngine(CALL, "5")
    h = server.open_session(engine.generate)

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(eval(expression, {"__builtins__": {}}))  # the test's own expression

    async with client_for(server, h) as c:
        agent = Agent(name="calc", tools=[calculator], model=OpenAIResponsesModel("policy", openai_client=c))
        result = await Runner.run(agent, "2+3=", max_turns=3)
    assert result.final_output == "5"
    first = engine.requests[0].input_ids.tolist()
    assert engine.requests[1].input_ids.tolist() == first + enc(CALL) + [EOS] + enc(TOOL_RESULT)
    exact(h, engine, 2)


# -- Anthropic Messages ------------------------------------------------------------------------------------------
async def test_messages_plain_system_and_usage(server):
    engine = FakeEngine("19")
    h = server.open_session(engine.generate)
    async with claude_for(server, h) as c:
        r = await c.messages.create(model="m", max_tokens=8, system="Add. ",
                                    messages=[{"role": "user", "content": "12+7="}])
    assert r.content[0].text == "19" and r.stop_reason == "end_turn" and r.usage.output_tokens == 3
    assert engine.requests[0].input_ids.tolist() == enc("Add. <|user|>12+7=<|assistant|>")
    assert engine.requests[0].gconfig.max_new_tokens == 8
    exact(h, engine, 1)


async def test_messages_tool_use_continues_exactly_and_streams(server):
    engine = FakeEngine(CALL, "5")
    h = server.open_session(engine.generate)
    messages = [{"role": "user", "content": "2+3="}]
    async with claude_for(server, h) as c:
        async with c.messages.stream(model="m", max_tokens=64, messages=messages, tools=[CLAUDE_TOOL]) as s:
            r1 = await s.get_final_message()
        assert r1.stop_reason == "tool_use" and r1.content[0].type == "tool_use"
        assert r1.content[0].input == {"expression": "2+3"} and r1.content[0].name == "calculator"
        messages += [{"role": "assistant", "content": r1.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r1.content[0].id,
                                                   "content": "5"}]}]
        r2 = await c.messages.create(model="m", max_tokens=64, messages=messages, tools=[CLAUDE_TOOL])
    assert r2.content[0].text == "5"
    first = engine.requests[0].input_ids.tolist()
    assert engine.requests[1].input_ids.tolist() == first + enc(CALL) + [EOS] + enc(TOOL_RESULT)
    exact(h, engine, 2)


async def test_messages_stop_sequence_and_refusals_in_anthropic_shape(server):
    engine = FakeEngine("19!")
    h = server.open_session(engine.generate)

    async def stop_engine(req):  # the engine stops on the "!" token: the request carried it
        resp = await engine.generate(req)
        s = resp.samples[0]
        s.output_ids, s.output_logprobs, s.output_versions = s.output_ids[:-1], s.output_logprobs[:-1], \
            s.output_versions[:-1]
        return resp

    h.generate = stop_engine
    async with claude_for(server, h) as c:
        r = await c.messages.create(model="m", max_tokens=8, stop_sequences=["!"],
                                    messages=[{"role": "user", "content": "12+7="}])
        assert r.stop_reason == "stop_sequence" and r.stop_sequence == "!" and r.content[0].text == "19"
        assert enc("!")[0] in engine.requests[0].gconfig.stop_token_ids
        bad = [{"stop_sequences": ["two"]}, {"extra_body": {"temperature": 1.5}}, {"tool_choice": {"type": "any"}},
               {"output_config": {"format": {"type": "json_schema", "schema": {}}}},
               {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
               {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "pre"}]},
               {"thinking": {"type": "enabled", "budget_tokens": 1024}}]
        for kw in bad:
            with pytest.raises(anthropic.BadRequestError) as e:
                await c.messages.create(**({"model": "m", "max_tokens": 8,
                                            "messages": [{"role": "user", "content": "q"}]} | kw))
            assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error", kw
    async with aiohttp.ClientSession() as http:  # max_tokens is required, as Anthropic's
        async with http.post(server.session_root(h) + "/v1/messages", headers={"x-api-key": server.api_key(h)},
                             json={"model": "m", "messages": [{"role": "user", "content": "q"}]}) as resp:
            assert resp.status == 400 and "max_tokens" in (await resp.json())["error"]["message"]
    async with anthropic.AsyncAnthropic(base_url=server.session_root(h), api_key="nope", max_retries=0) as c:
        with pytest.raises(anthropic.AuthenticationError) as e:
            await c.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "q"}])
        assert e.value.body["error"]["type"] == "authentication_error"


async def test_one_session_may_switch_dialect_and_still_continue_exactly(server):
    """The three dialects share one session machinery: a turn by chat, continued by Messages, is one sequence."""
    engine = FakeEngine("18", "19")
    h = server.open_session(engine.generate)
    async with client_for(server, h) as c:
        r1 = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "12+7="}])
    async with claude_for(server, h) as c:
        await c.messages.create(model="m", max_tokens=8, messages=[
            {"role": "user", "content": "12+7="}, {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "Wrong, try again."}])
    first = engine.requests[0].input_ids.tolist()
    assert engine.requests[1].input_ids.tolist() == first + enc("18") + [EOS] + enc("<|user|>Wrong, try again."
                                                                                    "<|assistant|>")
    exact(h, engine, 2)


async def test_an_answer_cut_by_the_budget_is_incomplete_and_max_tokens(server):
    engine = FakeEngine("12", "12")

    async def cut(req):  # the engine stopped at the token budget: no eos, finish "length"
        resp = await engine.generate(req)
        s = resp.samples[0]
        s.output_ids, s.output_logprobs, s.output_versions = s.output_ids[:-1], s.output_logprobs[:-1], \
            s.output_versions[:-1]
        s.finish_reason = "length"
        return resp

    h = server.open_session(cut)
    async with client_for(server, h) as c:
        r = await c.responses.create(model="m", input="q", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.output_text == "12"
    async with claude_for(server, h) as c:
        m = await c.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "p"}])
    assert m.stop_reason == "max_tokens" and m.content[0].text == "12"
