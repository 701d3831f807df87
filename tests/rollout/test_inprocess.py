"""The in-process path: the clients the endpoint hands to agents in the worker reach `dispatch` without a socket
(they answer while no HTTP server listens), speak every dialect, and refuse as the socket path does."""

from __future__ import annotations

import anthropic
import openai
import pytest

from arl.api import GenerationConfig
from arl.rollout.endpoint import EndpointServer
from tests.rollout.test_endpoint import EOS, TOK, FakeEngine, enc

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


async def test_in_process_clients_need_no_listening_server():
    s = EndpointServer(TOK, GenerationConfig(max_new_tokens=8, stop_token_ids=[EOS]), max_context_len=256)
    engine = FakeEngine("19", "18", "17")
    h = s.open_session(engine.generate)
    try:  # never started: nothing listens on any port
        c = s.openai_client().with_options(base_url=s.session_url(h), api_key=s.api_key(h))
        r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "12+7="}])
        assert r.choices[0].message.content == "19"
        r = await c.responses.create(model="m", input="1+1=")
        assert r.output_text == "18"
        a = s.anthropic_client().with_options(base_url=s.session_root(h), api_key=s.api_key(h))
        m = await a.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "2+2="}])
        assert m.content[0].text == "17"
        assert engine.requests[0].input_ids.tolist() == enc("<|user|>12+7=<|assistant|>")
        with pytest.raises(openai.AuthenticationError):
            await c.with_options(api_key="wrong").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}])
        with pytest.raises(anthropic.BadRequestError):
            await a.messages.create(model="m", max_tokens=8, messages=[{"role": "assistant", "content": "q"}])
        with pytest.raises(openai.NotFoundError):
            await c.with_options(base_url=s.url + "/v1/nowhere").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}])
    finally:
        await s.close()


async def test_without_in_process_the_clients_use_the_socket():
    s = EndpointServer(TOK, GenerationConfig(max_new_tokens=8, stop_token_ids=[EOS]), max_context_len=256,
                       in_process=False)
    h = s.open_session(FakeEngine("19").generate)
    try:
        c = s.openai_client().with_options(base_url=s.session_url(h), api_key=s.api_key(h))
        with pytest.raises(openai.APIConnectionError):  # port 0: no server
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        await s.start()
        c = s.openai_client().with_options(base_url=s.session_url(h), api_key=s.api_key(h))
        r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        assert r.choices[0].message.content == "19"
    finally:
        await s.close()
