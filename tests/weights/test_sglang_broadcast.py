"""The sender -> an SGLang server over its distributed weight-update endpoints, against the fake server
(tests/inference/fake_sglang.py), which joins the group and receives over gloo the way SGLang 0.5.23 does."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch
from safetensors.numpy import save_file

from arl.weights.group import WeightTransferError
from arl.weights.plan import make_plan
from arl.weights.sender import WeightSender
from arl.weights.sglang import SGLangWeightClient
from tests.inference.fake_sglang import FakeSGLang, toy_greedy

TIMEOUT = 30.0


@pytest_asyncio.fixture
async def fake(tmp_path: Path):
    d = tmp_path / "base"
    d.mkdir()
    save_file({"w": np.zeros(1, np.float32)}, str(d / "model.safetensors"))
    server = FakeSGLang(str(d))
    server.group_timeout_s = TIMEOUT
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def sender():
    s = WeightSender("127.0.0.1", 0, timeout_s=TIMEOUT)
    yield s
    s.close()


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(32, 16, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(24, 16, generator=g),
            "model.norm.weight": torch.randn(16, generator=g)}


async def join(sender: WeightSender, client: SGLangWeightClient, name: str) -> None:
    await asyncio.gather(asyncio.to_thread(sender.open_group, name, 2, protocol="sglang"),
                         asyncio.to_thread(client.join))


async def push(sender: WeightSender, client: SGLangWeightClient, version: int, sd: dict, **plan_kw) -> None:
    plan = make_plan(sd, wire_dtype="float16", **plan_kw)
    await asyncio.gather(asyncio.to_thread(sender.send, version, sd, plan=plan, groups=[client.spec.group_name]),
                         asyncio.to_thread(client.receive))


def generate(fake: FakeSGLang, prompt: list[int], n: int) -> list[int]:
    body = json.dumps({"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0}}).encode()
    req = urllib.request.Request(fake.base_url + "/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        return json.loads(r.read())["output_ids"]


@pytest.mark.asyncio
async def test_sender_to_fake_sglang_in_buckets_with_version(fake: FakeSGLang, sender: WeightSender) -> None:
    client = SGLangWeightClient(fake.base_url, sender.spec("sgl-0"), timeout_s=TIMEOUT)
    await join(sender, client, "sgl-0")
    init = fake.posts("/init_weights_update_group")
    assert init == [{"master_address": "127.0.0.1", "master_port": sender.port, "rank_offset": 1, "world_size": 2,
                     "group_name": "sgl-0", "backend": "gloo"}]
    sd = state(1)
    await push(sender, client, 3, sd, bucket_bytes=780)  # three buckets: three update calls in one session
    paths = [p for p, _ in fake.log if p != "/generate"]
    assert paths == ["/init_weights_update_group", "/begin_weight_update"] + \
        ["/update_weights_from_distributed"] * 3 + ["/end_weight_update"]
    updates = fake.posts("/update_weights_from_distributed")
    assert [u.get("weight_version") for u in updates] == [None, None, "3"]
    assert sorted(fake.received) == sorted(sd)
    for n, t in sd.items():
        assert fake.received[n].dtype == torch.float16 and torch.equal(fake.received[n], t.half()), n
    assert fake.weight_version == "3" and client.version == 3
    shift = 1 + int(round(abs(sum(float(t.half().double().sum()) for t in sd.values())))) % 7
    assert await asyncio.to_thread(generate, fake, [5], 4) == toy_greedy([5], 4, shift, fake.vocab)  # the server serves the new weights

    sd2 = state(2)
    await push(sender, client, 4, sd2)  # one bucket
    assert fake.weight_version == "4" and torch.equal(fake.received["model.norm.weight"],
                                                      sd2["model.norm.weight"].half())
    await asyncio.to_thread(client.close)
    assert fake.posts("/destroy_weights_update_group") == [{"group_name": "sgl-0"}] and not fake.groups


@pytest.mark.asyncio
async def test_a_failed_load_reaches_the_sender_and_a_restarted_server_rejoins(fake: FakeSGLang) -> None:
    """A server that refuses the update (a session left open) makes both sides fail with its message and the
    sender drop the group; a fresh group (as after a restart) then gets the newest weights."""
    sender = WeightSender("127.0.0.1", 0, timeout_s=10.0)
    try:
        await _failed_load_then_rejoin(fake, sender)
    finally:
        sender.close()


async def _failed_load_then_rejoin(fake: FakeSGLang, sender: WeightSender) -> None:
    client = SGLangWeightClient(fake.base_url, sender.spec("sgl-a"), timeout_s=TIMEOUT)
    await join(sender, client, "sgl-a")
    fake.session = True  # begin_weight_update will answer 400
    sd = state(5)
    results = await asyncio.gather(asyncio.to_thread(sender.send, 1, sd, groups=["sgl-a"]),
                                   asyncio.to_thread(client.receive), return_exceptions=True)
    assert all(isinstance(r, WeightTransferError) for r in results), results
    assert "a weight-update session is already open" in str(results[1])
    assert "a weight-update session is already open" in results[0].failures["sgl-a"]
    assert sender.groups == []
    fake.session = False
    await asyncio.to_thread(client.close)

    again = SGLangWeightClient(fake.base_url, sender.spec("sgl-a-1"), timeout_s=TIMEOUT)
    await join(sender, again, "sgl-a-1")
    await push(sender, again, 1, sd)
    assert fake.weight_version == "1"
    assert all(torch.equal(fake.received[n], t.half()) for n, t in sd.items())
    await asyncio.to_thread(again.close)
