"""The SGLang backend's LoRA path against the fake server's schema (SGLang 0.5.23's /load_lora_adapter,
/unload_lora_adapter, /generate's lora_path): one adapter per version, requests keep the adapter they were admitted
with, adapters older than eta + 1 versions are unloaded once no request runs on them (bounded memory)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from arl.api.types import GenerateRequest
from arl.inference.sglang_engine import SGLangError, lora_server_args, server_command
from arl.weights.adapter import LORA_A, LORA_B
from tests.inference.fake_sglang import toy_greedy
from tests.inference.test_sglang_engine import VOCAB, fake, make_engine, req, wait_tokens  # noqa: F401

pytest.importorskip("aiohttp")


def adapter_file(path: Path, k: int) -> str:
    """An adapter payload file whose toy-model shift (under the fake server) is 1 + (6 k) % 7."""
    m = "model.layers.0.self_attn.q_proj"
    save_file({m + LORA_A: torch.full((2, 3), float(k)), m + LORA_B: torch.zeros(4, 2)}, str(path))
    return str(path)


def preq(qid: str, ids, policy: str, **g) -> GenerateRequest:
    return dataclasses.replace(req(qid, ids, **g), policy=policy)


def shift(k: int) -> int:
    return 1 + (6 * k) % 7


@pytest.mark.asyncio
async def test_adapters_per_version_requests_keep_theirs_and_old_ones_are_unloaded(fake, tmp_path):  # noqa: F811
    engine = make_engine(fake, tmp_path, adapters_keep=2)  # eta = 1
    base = [asyncio.create_task(engine.agenerate(req(f"b{i}", [1 + i, 2], greedy=True, max_new_tokens=40)))
            for i in range(4)]
    await wait_tokens(fake, 3)
    await engine.update_weights(adapter_file(tmp_path / "v1.safetensors", 1), 1)
    assert engine.version == 1
    # no pause: the requests in flight go on, on the base weights and their version
    assert not fake.posts("/pause_generation") and not fake.posts("/update_weights_from_disk")
    load = fake.posts("/load_lora_adapter")[0]
    assert load["lora_name"] == "arl-v1" and os.path.isfile(os.path.join(load["lora_path"], "adapter_config.json"))
    for i, r in enumerate(await asyncio.gather(*base)):
        s = r.samples[0]
        assert r.error is None and s.output_versions.tolist() == [0] * 40
        assert s.output_ids.tolist() == toy_greedy([1 + i, 2], 40, 1, VOCAB)
    # a request admitted now carries v1's adapter, to its end, whatever loads meanwhile
    long = asyncio.create_task(engine.agenerate(req("long", [5, 6], greedy=True, max_new_tokens=200)))
    await wait_tokens(fake, 2)
    for v in (2, 3, 4):
        await engine.update_weights(adapter_file(tmp_path / f"v{v}.safetensors", v), v)
    assert 1 in engine.adapters_loaded  # in use: kept
    assert engine.adapters_loaded == [1, 3, 4]  # v2 (below 4 - 1, unused) is gone
    r = await long
    s = r.samples[0]
    assert r.error is None and s.output_versions.tolist() == [1] * 200
    assert s.output_ids.tolist() == toy_greedy([5, 6], 200, shift(1), VOCAB)
    gen = [b for b in fake.posts("/generate") if b.get("lora_path")]
    assert gen and gen[0]["lora_path"] == "arl-v1"
    # new requests get the newest adapter; the next update unloads v1 and v3 (nothing runs on them any more)
    r = await engine.agenerate(req("new", [7, 8], greedy=True, max_new_tokens=5))
    assert r.samples[0].output_versions.tolist() == [4] * 5
    assert r.samples[0].output_ids.tolist() == toy_greedy([7, 8], 5, shift(4), VOCAB)
    await engine.update_weights(adapter_file(tmp_path / "v5.safetensors", 5), 5)
    assert engine.adapters_loaded == [4, 5] and sorted(fake.adapters) == ["arl-v4", "arl-v5"]
    assert fake.unloaded_in_use == []
    assert not engine._adapter_users  # nothing in flight: no count kept per version served (a run of days)
    assert sorted(os.listdir(tmp_path / "w" / "lora")) == ["v4", "v5"]  # the folders of unloaded ones are gone
    # a load the server refuses: raised, version and adapter kept
    fake.max_loaded_loras = 2
    with pytest.raises(SGLangError, match="maximum number of loaded adapters"):
        await engine.update_weights(adapter_file(tmp_path / "v6.safetensors", 6), 6)
    assert engine.version == 5
    r = await engine.agenerate(req("after", [7, 8], greedy=True, max_new_tokens=3))
    assert r.samples[0].output_versions.tolist() == [5] * 3
    # a full weights file still goes the usual way (pause, update_weights_from_disk)
    await engine.close()


@pytest.mark.asyncio
async def test_named_lora_policies_are_served_beside_the_runs_own(fake, tmp_path):  # noqa: F811
    engine = make_engine(fake, tmp_path, adapters_keep=2)
    await engine.update_weights(adapter_file(tmp_path / "own1.safetensors", 1), 1)
    await engine.update_weights(adapter_file(tmp_path / "s3.safetensors", 2), 3, policy="solver")
    assert engine.version == 1 and engine.adapters_loaded == [1] and engine.policy_adapters_loaded("solver") == [3]
    assert sorted(fake.adapters) == ["arl-solver-v3", "arl-v1"]
    own, solver = await asyncio.gather(engine.agenerate(req("o", [7, 8], greedy=True, max_new_tokens=5)),
                                       engine.agenerate(preq("s", [7, 8], "solver", greedy=True,
                                                             max_new_tokens=5)))
    assert own.samples[0].output_versions.tolist() == [1] * 5
    assert own.samples[0].output_ids.tolist() == toy_greedy([7, 8], 5, shift(1), VOCAB)
    assert solver.samples[0].output_versions.tolist() == [3] * 5  # the policy's own version
    assert solver.samples[0].output_ids.tolist() == toy_greedy([7, 8], 5, shift(2), VOCAB)
    assert {b["lora_path"] for b in fake.posts("/generate")} == {"arl-v1", "arl-solver-v3"}
    bad = await engine.agenerate(preq("x", [7, 8], "proposer", max_new_tokens=2))
    assert bad.error is not None and "unknown policy 'proposer'" in bad.error and "solver" in bad.error
    # a policy's updates unload only its own old adapters
    for v in (4, 5):
        await engine.update_weights(adapter_file(tmp_path / f"s{v}.safetensors", v), v, policy="solver")
    assert engine.policy_adapters_loaded("solver") == [4, 5] and engine.adapters_loaded == [1]
    assert sorted(os.listdir(tmp_path / "w" / "lora" / "solver")) == ["v4", "v5"]
    with pytest.raises(ValueError, match="holds full weights"):
        full = tmp_path / "full.safetensors"
        save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(full))
        await engine.update_weights(str(full), 6, policy="solver")
    with pytest.raises(ValueError, match="letters, digits"):
        await engine.update_weights(adapter_file(tmp_path / "e.safetensors", 1), 1, policy="../up")
    await engine.close()
    plain = make_engine(fake, tmp_path)  # a server without --enable-lora
    with pytest.raises(ValueError, match="serves no LoRA policies"):
        await plain.update_weights(adapter_file(tmp_path / "p.safetensors", 1), 1, policy="solver")
    await plain.close()


def test_server_gets_the_lora_flags():
    cmd = server_command(model_path="/m", host="h", port=1, device="cuda", seed=0,
                         extra_args=lora_server_args(16, ["q_proj", "v_proj"], 3))
    i = cmd.index("--enable-lora")
    assert cmd[i:] == ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj",
                       "--max-loaded-loras", "5", "--max-loras-per-batch", "5"]
