"""The SGLang backend against a fake server that speaks SGLang 0.5.23's HTTP schema (tests/inference/fake_sglang.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from safetensors.numpy import save_file

from arl.api.engine import InferenceEngine
from arl.api.types import GenerateRequest, GenerationConfig
from arl.inference.sglang_engine import SGLangEngine, SGLangError, server_command, server_gpus
from tests.inference.fake_sglang import FakeSGLang, toy_greedy
from tests.waiting import await_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 64


def weights_file(path: Path, k: int) -> str:
    """A safetensors file whose toy-model shift is 1 + k % 7."""
    save_file({"w": np.array([float(k)], np.float32)}, str(path))
    return str(path)


def model_dir(tmp_path: Path, k: int = 0) -> str:
    d = tmp_path / "base"
    d.mkdir(exist_ok=True)
    weights_file(d / "model.safetensors", k)
    (d / "config.json").write_text("{}")
    return str(d)


def req(qid: str, ids, **g) -> GenerateRequest:
    return GenerateRequest(qid=qid, input_ids=np.asarray(ids, np.int32), gconfig=GenerationConfig(**g))


@pytest_asyncio.fixture
async def fake(tmp_path):
    server = FakeSGLang(model_dir(tmp_path, 0), vocab=VOCAB, step_s=0.002)
    await server.start()
    yield server
    await server.stop()


def make_engine(fake: FakeSGLang, tmp_path: Path, **kw) -> SGLangEngine:
    args = dict(model_path=str(tmp_path / "base"), name="sgl", health_interval=0, weights_dir=str(tmp_path / "w"),
                request_timeout=30, control_timeout=30)
    args.update(kw)
    return SGLangEngine(fake.base_url, **args)


async def wait_tokens(fake: FakeSGLang, n: int, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not fake.running or min(len(r.ids) for r in fake.running.values()) < n:
        assert loop.time() < end, "requests did not start"
        await asyncio.sleep(0.002)


@pytest.mark.asyncio
async def test_generate_uses_sglang_schema_and_parses_answers(fake, tmp_path):
    engine = make_engine(fake, tmp_path)
    assert isinstance(engine, InferenceEngine)
    r = await engine.agenerate(req("a", [5, 9, 2], greedy=True, max_new_tokens=7, n=3))
    assert r.error is None and len(r.samples) == 3
    want = toy_greedy([5, 9, 2], 7, 1, VOCAB)
    for s in r.samples:
        assert s.output_ids.tolist() == want and s.finish_reason == "length"
        assert np.allclose(s.output_logprobs, -0.05) and s.output_versions.tolist() == [0] * 7
    body = fake.posts("/generate")[0]
    assert body["input_ids"] == [5, 9, 2] and body["return_logprob"] is True
    assert body["sampling_params"] == {"max_new_tokens": 7, "min_new_tokens": 0, "temperature": 0.0}
    r = await engine.agenerate(req("b", [1], max_new_tokens=4, min_new_tokens=2, temperature=0.7,
                                   stop_token_ids=[want[0]]))
    assert r.error is None and len(r.samples[0].output_logprobs) == len(r.samples[0].output_ids)
    assert fake.posts("/generate")[-1]["sampling_params"] == {
        "max_new_tokens": 4, "min_new_tokens": 2, "temperature": 0.7, "top_p": 1.0, "top_k": -1,
        "stop_token_ids": [want[0]]}
    # a stop token ends the sample and is part of it
    r = await engine.agenerate(req("c", [5, 9, 2], greedy=True, max_new_tokens=7, stop_token_ids=[want[2]]))
    assert r.samples[0].output_ids.tolist() == want[:3] and r.samples[0].finish_reason == "stop"
    await engine.close()


@pytest.mark.asyncio
async def test_without_version_spans_tokens_get_the_submitted_version(fake, tmp_path):
    """An answer with only the server's final weight_version (no per-token spans): an update during the request
    made that newer than the early tokens, so every token gets the version it was submitted under (staler)."""
    engine = make_engine(fake, tmp_path)
    lp = [[-0.1, 7, None], [-0.2, 8, None]]
    answer = {"output_ids": [7, 8], "meta_info": {"output_token_logprobs": lp, "finish_reason": {"type": "length"},
                                                  "weight_version": "5"}}
    assert engine._parse_generate(answer, 3)[2] == [3, 3]
    assert engine._parse_generate(answer, 5)[2] == [5, 5]
    del answer["meta_info"]["weight_version"]
    assert engine._parse_generate(answer, 4)[2] == [4, 4]
    spans = [{"version": "3", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 2}]
    answer["meta_info"]["weight_versions"] = spans  # spans say exactly which token came from which version
    assert engine._parse_generate(answer, 3)[2] == [3, 5]
    await engine.close()


@pytest.mark.asyncio
async def test_truncated_sampling_is_refused_with_a_clear_error(fake, tmp_path):
    """SGLang reports logprobs before top-p/top-k truncation: such a request would get dishonest behaviour
    logprobs, so it is refused before it reaches the server; greedy and untruncated sampling are served."""
    engine = make_engine(fake, tmp_path)
    for g in (dict(top_p=0.5), dict(top_k=3), dict(top_p=0.5, top_k=3, temperature=0.9)):
        r = await engine.agenerate(req("t", [1, 2], max_new_tokens=3, **g))
        assert r.samples == [] and r.error is not None
        assert "cannot report behaviour logprobs" in r.error and "top_p=1.0 and gen.top_k=0" in r.error
    assert fake.posts("/generate") == [] and engine.stats()["requests_refused"] == 3
    for g in (dict(greedy=True, top_p=0.5, top_k=3), dict(temperature=0.9)):
        r = await engine.agenerate(req("ok", [1, 2], max_new_tokens=3, **g))
        assert r.error is None and len(r.samples) == 1
    await engine.close()


@pytest.mark.asyncio
async def test_bad_input_and_server_errors_come_back_as_errors(fake, tmp_path):
    engine = make_engine(fake, tmp_path, max_context_len=16)
    bad = [req("e", []), req("n", [1], n=0), req("long", list(range(16))), "not a request"]
    for b in bad:
        r = await engine.agenerate(b)  # type: ignore[arg-type]
        assert r.error is not None and r.samples == []
    assert fake.posts("/generate") == []
    r = await engine.agenerate(req("oov", [VOCAB + 5], max_new_tokens=2))  # the server answers 400
    assert r.error is not None and "400" in r.error
    # prompt + output stop at max_context_len, as in the embedded engine
    r = await engine.agenerate(req("cap", list(range(1, 13)), greedy=True, max_new_tokens=50))
    assert r.error is None and len(r.samples[0].output_ids) == 4
    assert engine.stats()["requests_refused"] == 4
    await engine.close()
    r = await engine.agenerate(req("closed", [1]))
    assert r.error == "engine closed"


@pytest.mark.asyncio
async def test_unreachable_server_gives_errors_not_exceptions(tmp_path):
    engine = SGLangEngine("http://127.0.0.1:9", health_interval=0, request_timeout=5, control_timeout=5)
    r = await engine.agenerate(req("x", [1, 2]))
    assert r.error is not None and "sglang" in r.error
    with pytest.raises(SGLangError):
        await engine.update_weights(weights_file(tmp_path / "w.safetensors", 1), 1)
    assert engine.version == 0
    await engine.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
async def test_update_mid_flight_loses_no_request_and_tags_versions(fake, tmp_path, mode):
    engine = make_engine(fake, tmp_path, pause_mode=mode)
    prompts = [[1 + i % 50, 2 + i % 7] for i in range(32)]
    max_new = 30
    tasks = [asyncio.create_task(engine.agenerate(req(f"q{i}", p, greedy=True, max_new_tokens=max_new)))
             for i, p in enumerate(prompts)]
    await wait_tokens(fake, 3)
    new = weights_file(tmp_path / "v1.safetensors", 3)  # shift 4
    await engine.update_weights(new, 1)
    assert engine.version == 1
    resps = await asyncio.gather(*tasks)
    seen: set[int] = set()
    for p, r in zip(prompts, resps):
        assert r.error is None
        s = r.samples[0]
        assert len(s.output_ids) == max_new and s.finish_reason == "length"  # none lost or cut
        v = s.output_versions.tolist()
        assert v == sorted(v) and set(v) <= {0, 1}
        seen |= set(v)
        n_old = v.count(0)
        assert 3 <= n_old < max_new
        ids = s.output_ids.tolist()
        assert ids[:n_old] == toy_greedy(p, n_old, 1, VOCAB)  # old weights before the update ...
        assert ids[n_old:] == toy_greedy(p + ids[:n_old], max_new - n_old, 4, VOCAB)  # ... new ones after
    assert seen == {0, 1}
    order = [path for path, _ in fake.log if path != "/generate"]
    assert order == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert fake.posts("/pause_generation")[0] == {"mode": mode}
    upd = fake.posts("/update_weights_from_disk")[0]
    assert upd["weight_version"] == "1" and upd["flush_cache"] is (mode != "in_place")
    assert os.path.isfile(os.path.join(upd["model_path"], "model.safetensors"))
    assert os.path.islink(os.path.join(upd["model_path"], "config.json"))
    assert (engine.stats()["resubmits"] > 0) is (mode == "abort")
    # after the update: new requests follow the new weights and carry the new version
    r = await engine.agenerate(req("after", [7, 8], greedy=True, max_new_tokens=5))
    assert r.samples[0].output_ids.tolist() == toy_greedy([7, 8], 5, 4, VOCAB)
    assert r.samples[0].output_versions.tolist() == [1] * 5
    await engine.close()


@pytest.mark.asyncio
async def test_failed_update_keeps_version_and_resumes(fake, tmp_path):
    engine = make_engine(fake, tmp_path)
    with pytest.raises(FileNotFoundError):
        await engine.update_weights(str(tmp_path / "missing.safetensors"), 1)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SGLangError, match="update_weights_from_disk"):
        await engine.update_weights(str(empty), 2)
    assert engine.version == 0 and not fake.paused  # generation was resumed
    r = await engine.agenerate(req("x", [3], greedy=True, max_new_tokens=3))
    assert r.error is None and r.samples[0].output_versions.tolist() == [0, 0, 0]
    # a directory source is handed to SGLang as it is
    d = tmp_path / "hf"
    d.mkdir()
    weights_file(d / "model.safetensors", 1)
    await engine.update_weights(str(d), 5)
    assert fake.posts("/update_weights_from_disk")[-1]["model_path"] == str(d.resolve()) and engine.version == 5
    await engine.close()


@pytest.mark.asyncio
async def test_old_weight_dirs_are_pruned(fake, tmp_path):
    engine = make_engine(fake, tmp_path)
    for v in range(1, 5):
        await engine.update_weights(weights_file(tmp_path / f"v{v}.safetensors", v), v)
    assert sorted(os.listdir(tmp_path / "w")) == ["v3", "v4"]
    await engine.close()


@pytest.mark.asyncio
async def test_health_watcher_reports_a_dead_server(tmp_path):
    fake = FakeSGLang(model_dir(tmp_path), vocab=VOCAB)
    await fake.start()
    engine = make_engine(fake, tmp_path, health_interval=0.05, max_health_failures=2)
    await engine.start()
    failed = asyncio.create_task(engine.wait_failed())
    await await_until(lambda: fake.health_calls >= 3, 30, "three health checks")  # passed: not failed
    assert not failed.done()
    fake.healthy = False
    reason = await asyncio.wait_for(failed, 5)
    assert "/health failed" in reason
    r = await engine.agenerate(req("x", [1]))
    assert r.error is not None and "failed" in r.error
    await engine.close()
    await fake.stop()


def _python_stand_in(path: Path, body: str) -> str:
    """An executable that stands in for `inference.sglang.python`: it is run as `<it> -m sglang.launch_server ...`."""
    path.write_text("#!/bin/sh\nshift 2  # -m sglang.launch_server\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_factory_launches_supervises_and_stops_the_server(tmp_path):
    """Through the `sglang` backend of the registry, with the fake as the server (`inference.sglang.python` runs it
    on sglang's command line): ready wait, serving, death detection, the inference worker exiting on it, and the
    server process stopped on close."""
    from arl.config import InferenceConfig, SGLangConfig
    from arl.inference.factory import build_engine
    from arl.inference.worker import InferenceWorker

    base = model_dir(tmp_path)
    fake_python = _python_stand_in(tmp_path / "fake-python",
                                   f'exec {sys.executable} -m tests.inference.fake_sglang "$@"')
    ic = InferenceConfig(backend="sglang", max_batch_size=8, max_context_len=64,
                         sglang=SGLangConfig(python=fake_python, startup_timeout=60))
    env_pp = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = ROOT + (os.pathsep + env_pp if env_pp else "")
    try:
        engine = await asyncio.to_thread(build_engine, base, ic, seed=0, index=0, run_dir=str(tmp_path / "run"))
    finally:
        if env_pp is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_pp
    server = engine.server
    assert server is not None and server.exit_code() is None  # running
    assert os.path.isfile(tmp_path / "run" / "logs" / "inference0-sglang.log")
    r = await engine.agenerate(req("x", [5, 9, 2], greedy=True, max_new_tokens=4))
    assert r.samples[0].output_ids.tolist() == toy_greedy([5, 9, 2], 4, 1, VOCAB)

    class NoRequests:
        async def recv(self):
            await asyncio.Event().wait()

    worker = InferenceWorker(index=0, engine=engine, router=NoRequests(), send_control=None)  # type: ignore
    serving = asyncio.create_task(worker.serve())
    os.killpg(server.proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="inference backend failed: sglang server exited"):
        await asyncio.wait_for(serving, 30)  # the health watcher looks every 5 s
    await engine.close()
    assert server.exit_code() is not None  # stopped

    # a server that dies while starting: a clear error with its log's last lines
    ic.sglang.python = _python_stand_in(tmp_path / "dying-python", "echo boom; exit 3")
    with pytest.raises(SGLangError, match="(?s)exited with code 3 while starting.*boom"):
        build_engine(base, ic, seed=0, index=1, run_dir=str(tmp_path / "run"))


def test_server_command_and_gpu_groups():
    cmd = server_command(model_path="/m", host="127.0.0.1", port=3000, device="cpu", seed=7, python="/py",
                         max_running_requests=16, extra_args=["--log-level", "warning"])
    assert cmd[:3] == ["/py", "-m", "sglang.launch_server"]
    for flag, value in [("--model-path", "/m"), ("--port", "3000"), ("--device", "cpu"), ("--random-seed", "7"),
                        ("--max-running-requests", "16"), ("--attention-backend", "torch_native")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert cmd[-2:] == ["--log-level", "warning"]
    gpu = server_command(model_path="/m", host="h", port=1, device="cuda", seed=0)
    assert "--attention-backend" not in gpu and gpu[gpu.index("--device") + 1] == "cuda"
    assert server_gpus(0, 1) == "0" and server_gpus(3, 1, first_gpu=1) == "4"
    assert server_gpus(1, 2) == "2,3" and server_gpus(1, 2, visible="4,5,6,7") == "6,7"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        server_gpus(2, 2, visible="0,1,2,3")
