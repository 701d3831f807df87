"""The SGLang backend against the real SGLang server on the CPU (tiny model). Run by scripts/test_sglang_cpu.sh.

Skipped unless ARL_SGLANG_REAL=1 and sglang is importable (the script builds a separate venv with SGLang and puts
the test-only `sgl_kernel` stub on PYTHONPATH). Checks: greedy tokens equal the embedded engine's on the same
weights; after update_weights_from_disk the outputs follow the new weights and carry the new version; requests in
flight during an update complete (KV kept with pause_mode in_place, recomputed with retract); with
weights.transport=broadcast the learner's publisher sends two versions through one weight-update group to the server
(flattened buckets, the tied lm_head left out) and the server then computes what torch computes with them.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import os

import numpy as np
import pytest
import torch

from tests.waiting import await_until

pytestmark = [
    pytest.mark.sglang_real,
    pytest.mark.skipif(os.environ.get("ARL_SGLANG_REAL") != "1" or importlib.util.find_spec("sglang") is None,
                       reason="real SGLang tests run via scripts/test_sglang_cpu.sh"),
]

torch.set_num_threads(1)

MAX_NEW = 120


def _export(model: torch.nn.Module, path: str) -> str:
    """One safetensors file of the full state dict, as the learner exports it."""
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from arl.config import SGLangConfig
    from arl.inference.sglang_engine import launch_sglang_engine
    from arl.models.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    root = tmp_path_factory.mktemp("sglang-real")
    tok = build_char_tokenizer()
    old = build_tiny_model(len(tok), seed=0, max_position_embeddings=512)
    new = build_tiny_model(len(tok), seed=1, max_position_embeddings=512)
    base = save_model_dir(old, tok, str(root / "model"))
    new_file = _export(new, str(root / "v1.safetensors"))
    loop = asyncio.new_event_loop()  # the engine's HTTP session lives on one loop for the whole module
    engine = launch_sglang_engine(SGLangConfig(startup_timeout=300), model_path=base, device="cpu", seed=0, name="sgl",
                                  run_dir=str(root / "run"), max_batch_size=32, max_context_len=512, health_interval=5)
    yield {"engine": engine, "old": old, "new": new, "new_file": new_file, "base": base, "tok": tok, "root": root,
           "run": loop.run_until_complete}
    loop.run_until_complete(engine.close())
    loop.close()


def torch_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new: int, eos: int = 1, min_new: int = 0):
    """The embedded engine's greedy samples of `prompts` (same weights, same stop rules)."""
    from arl.api.types import GenerateRequest, GenerationConfig
    from arl.inference.torch_engine import TorchEngine

    async def go():
        engine = TorchEngine(model, pad_token_id=0, eos_token_id=eos, max_batch_size=64, max_context_len=512)
        rs = await asyncio.gather(*(engine.agenerate(GenerateRequest(
            qid=str(i), input_ids=np.asarray(p, np.int32), gconfig=GenerationConfig(
                greedy=True, max_new_tokens=max_new, min_new_tokens=min_new)))
            for i, p in enumerate(prompts)))
        await engine.close()
        return [r.samples[0] for r in rs]

    return asyncio.run(go())


def encode(tok, texts: list[str]) -> list[list[int]]:
    return [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)) for t in texts]


def sglang_generate(setup, prompts: list[list[int]], max_new: int, update=None, min_new: int = 0):
    """Greedy samples from the SGLang engine; `update` (a coroutine factory) runs while they are in flight."""
    from arl.api.types import GenerateRequest, GenerationConfig

    engine = setup["engine"]

    async def go():
        tasks = [asyncio.create_task(engine.agenerate(GenerateRequest(
            qid=str(i), input_ids=np.asarray(p, np.int32), gconfig=GenerationConfig(
                greedy=True, max_new_tokens=max_new, min_new_tokens=min_new))))
            for i, p in enumerate(prompts)]
        if update is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while engine.stats()["running_requests"] < len(prompts):  # every request is at the server
                assert loop.time() < deadline, "the requests did not reach the server"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # their prefill (the server has no "decoding started" signal to wait on)
            await update()
        return await asyncio.gather(*tasks)

    return setup["run"](go())


PROMPTS = ["12+7=", "3+4=", "40+9=", "hello", "Tell me a story", "0+0=", "25+25=", "9+"]


def test_greedy_tokens_equal_the_embedded_engine(setup):
    engine, tok = setup["engine"], setup["tok"]
    prompts = encode(tok, PROMPTS)
    ref = torch_greedy(setup["old"], prompts, 24)
    got = sglang_generate(setup, prompts, 24)
    for r, s in zip(got, ref):
        assert r.error is None, r.error
        g = r.samples[0]
        assert g.output_ids.tolist() == s.output_ids.tolist()
        assert g.finish_reason == s.finish_reason
        np.testing.assert_allclose(g.output_logprobs, s.output_logprobs, atol=2e-3)
        assert g.output_versions.tolist() == [0] * len(g.output_ids)


def _long_prompts(setup) -> list[list[int]]:
    """Six prompts; with min_new_tokens = MAX_NEW (eos masked in both engines) each runs the full MAX_NEW tokens
    whatever the random tiny model does, so an update lands in the middle of them."""
    return encode(setup["tok"], [f"{a}+{b}=" for a, b in ((3, 7), (12, 21), (30, 14), (45, 0), (6, 42), (27, 35))])


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_update_in_flight_completes_and_new_weights_follow(setup, mode):
    engine = setup["engine"]
    engine.pause_mode = mode
    prompts = _long_prompts(setup)
    version = {"in_place": 1, "retract": 2, "abort": 3}[mode]
    # each mode starts from the old weights
    if engine.version != 0:
        setup["run"](engine.update_weights(_export(setup["old"], str(setup["root"] / "v0.safetensors")), 0))

    async def update():
        await engine.update_weights(setup["new_file"], version)

    resps = sglang_generate(setup, prompts, MAX_NEW, update, min_new=MAX_NEW)
    old_ref = torch_greedy(setup["old"], prompts, MAX_NEW, min_new=MAX_NEW)
    spanned = 0
    for p, r, o in zip(prompts, resps, old_ref):
        assert r.error is None, r.error
        s = r.samples[0]
        v = s.output_versions.tolist()
        assert v == sorted(v) and set(v) <= {0, version}
        assert s.finish_reason == "length" and len(s.output_ids) == MAX_NEW
        n_old = v.count(0)
        ids = s.output_ids.tolist()
        assert ids[:n_old] == o.output_ids.tolist()[:n_old]  # made by the old weights
        if 0 < n_old < len(ids):
            spanned += 1
            if mode != "in_place":  # KV recomputed: the rest is the new model's greedy continuation of the prefix
                cont = torch_greedy(setup["new"], [p + ids[:n_old]], len(ids) - n_old, min_new=len(ids) - n_old)[0]
                assert ids[n_old:] == cont.output_ids.tolist()
    assert spanned >= 1, "no request was in flight across the update"
    if mode == "abort":
        assert engine.stats()["resubmits"] >= spanned  # aborted mid-way, then resubmitted from the prefix
    if mode == "in_place":  # in_place keeps old-weight prefixes in the radix cache until a flush on an idle server
        import urllib.request

        with urllib.request.urlopen(urllib.request.Request(engine.base_url + "/flush_cache", method="POST"),
                                    timeout=30) as r:
            assert r.status == 200
    # after the update: outputs follow the new weights and carry the new version
    prompts = encode(setup["tok"], PROMPTS)
    got = sglang_generate(setup, prompts, 16)
    ref = torch_greedy(setup["new"], prompts, 16)
    for r, s in zip(got, ref):
        assert r.samples[0].output_ids.tolist() == s.output_ids.tolist()
        assert r.samples[0].output_versions.tolist() == [version] * len(s.output_ids)


BROADCAST_BUCKET_BYTES = 100_000  # several buckets, most holding several tensors (the tiny models' are 0.5-800 KB)


def _fresh_like(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A newly initialised model of `model`'s class and config (other weights, same names and shapes)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = type(model)(model.config)
    return out.eval()


def _teacher_forced(model: torch.nn.Module, prompt: list[int], out: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The log-probabilities `model` gives each token of `out` after `prompt`, and its best log-probability there."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits, -1)
    return lp.gather(1, torch.tensor(out)[:, None])[:, 0].numpy(), lp.max(-1).values.numpy()


def _assert_served_by(samples: list, prompts: list[list[int]], model: torch.nn.Module, version: int) -> None:
    """Each greedy sample is `model`'s: its logprobs equal a torch forward of these weights (the server runs them
    in float16) and every token is that forward's argmax (up to the same tolerance); the tokens carry `version`."""
    for p, s in zip(prompts, samples):
        ids = s.output_ids.tolist()
        want, best = _teacher_forced(model, p, ids)
        np.testing.assert_allclose(s.output_logprobs, want, atol=2e-3)
        assert (want >= best - 2e-3).all(), "the server's greedy token is not the argmax of the new weights"
        assert s.output_versions.tolist() == [version] * len(ids)


def _max_logprob_gap(samples: list, prompts: list[list[int]], model: torch.nn.Module) -> float:
    return max(float(np.abs(s.output_logprobs - _teacher_forced(model, p, s.output_ids.tolist())[0]).max())
               for p, s in zip(prompts, samples))


def _broadcast_two_versions(engine, run, base: str, ref: torch.nn.Module, prompts: list[list[int]],
                            versions: tuple[int, int]) -> None:
    """The learner's `WeightPublisher` (protocol sglang) and the inference worker's `BroadcastLoader` (the code a
    run with weights.transport=broadcast uses) send two versions through one group to the real server `engine`,
    whose model is `ref`'s architecture with tied embeddings; the tied lm_head is left out of the sent tensors as
    the learner leaves it out (`tied_aliases`). The second version changes only the embeddings: the server's
    lm_head must follow them (a stale one is what an untied local copy computes, and that is told apart)."""
    from arl.api.types import GenerateRequest, GenerationConfig
    from arl.learner.export import tied_aliases
    from arl.weights.sender import WeightSender
    from arl.weights.channel import BroadcastLoader, WeightPublisher

    n_new = 16
    emb = "model.embed_tokens.weight"
    tied = tied_aliases(base)
    assert tied == {"lm_head.weight"} and ref.config.tie_word_embeddings
    m1 = _fresh_like(ref, seed=11)
    m2 = copy.deepcopy(m1)  # version 2: version 1 with other embeddings (so, with tying, another lm_head)
    with torch.no_grad():
        m2.get_input_embeddings().weight.copy_(_fresh_like(ref, seed=12).get_input_embeddings().weight)
    assert m2.lm_head.weight is m2.get_input_embeddings().weight
    stale = copy.deepcopy(m2)  # what a server whose lm_head kept version 1's embeddings would compute
    stale.lm_head.weight = torch.nn.Parameter(m1.get_input_embeddings().weight.detach().clone())

    def learner_state(m: torch.nn.Module) -> dict[str, torch.Tensor]:  # as LearnerWorker._state_dict
        return {k: v.detach().clone() for k, v in m.state_dict().items() if k not in tied}

    def generate() -> list:
        async def go():
            rs = await asyncio.gather(*(engine.agenerate(GenerateRequest(
                qid=f"b{i}", input_ids=np.asarray(p, np.int32), gconfig=GenerationConfig(
                    greedy=True, max_new_tokens=n_new)))  # no min_new_tokens: its eos mask shifts the logprobs
                for i, p in enumerate(prompts)))
            for r in rs:
                assert r.error is None, r.error
            return [r.samples[0] for r in rs]

        return run(go())

    before = generate()
    engine.pause_mode = "retract"
    sender = WeightSender("127.0.0.1", 0, timeout_s=60)
    publisher = WeightPublisher(sender, protocol="sglang", bucket_bytes=BROADCAST_BUCKET_BYTES)
    loader = BroadcastLoader(engine, timeout_s=60)
    runner = run(_start(publisher.run()))
    group = "arl-real-sglang-0"
    try:
        run(_gather(publisher.open_group(group, 0), loader.join(sender.spec(group))))  # each waits for the other
        assert sender.groups == [group] and publisher.stats["weight_groups"] == 1
        client = loader._member
        for k, (version, model) in enumerate(zip(versions, (m1, m2))):
            run(publisher.set_newest(version, learner_state(model)))
            plan = publisher.newest[1].plan
            names = [t.name for t in plan.tensors]
            assert "lm_head.weight" not in names and emb in names
            assert len(plan.buckets) > 1 and any(b - a > 1 for a, b in plan.buckets)  # flattened, several each
            publisher.request(version, [0])
            assert run(loader.load()) == version
            assert engine.version == version and client.version == version
            # the learner saw the server's outcome
            run(await_until(lambda: publisher.stats["weight_sends"] == k + 1, what="the send's outcome"))
            assert publisher.stats["weight_send_failures"] == 0
            after = generate()
            _assert_served_by(after, prompts, model, version)
            assert any(a.output_ids.tolist() != b.output_ids.tolist() for a, b in zip(after, before)), \
                "the greedy outputs did not change with the weights"
            before = after
        assert client.seq == 2 and sender.groups == [group]  # both versions went through the one group
        # the teeth of the tied check: a stale lm_head would give clearly other logprobs than the server's
        assert _max_logprob_gap(after, prompts, stale) > 0.05
        assert _max_logprob_gap(after, prompts, m1) > 0.05
    finally:
        runner.cancel()
        run(_gather(runner, return_exceptions=True))
        run(loader.close())
        publisher.close()


async def _gather(*aws, return_exceptions: bool = False) -> list:
    """`asyncio.gather` on the loop that runs it (not the default loop of the calling thread)."""
    return await asyncio.gather(*aws, return_exceptions=return_exceptions)


async def _start(coro) -> asyncio.Task:
    """A task on the running loop (it lives on across `run_until_complete` calls of that loop)."""
    return asyncio.create_task(coro)


def test_broadcast_through_the_server_group_llama(setup):
    """weights.transport=broadcast against the real server: the tiny Llama (tied embeddings) of the module."""
    prompts = encode(setup["tok"], PROMPTS)
    _broadcast_two_versions(setup["engine"], setup["run"], setup["base"], setup["old"], prompts, (101, 102))


def test_broadcast_through_the_server_group_qwen2(tmp_path):
    """The same with the real-model path's tiny Qwen2 (tied embeddings, GQA, biased q/k/v: SGLang stacks
    q/k/v and gate/up into fused parameters on load)."""
    from arl.config import SGLangConfig
    from arl.inference.sglang_engine import launch_sglang_engine
    from arl.models.qwen2_tiny import build_qwen2_tiny_dir
    from arl.models.tiny import load_model_dir

    folder = build_qwen2_tiny_dir(str(tmp_path / "qwen2"))
    model, tok = load_model_dir(folder)
    prompts = [tok(t)["input_ids"] for t in PROMPTS]
    loop = asyncio.new_event_loop()
    engine = launch_sglang_engine(SGLangConfig(startup_timeout=300), model_path=folder, device="cpu", seed=0,
                                  name="sgl-qwen2-bc", run_dir=str(tmp_path / "run"), max_batch_size=16,
                                  max_context_len=512, health_interval=5)
    try:
        _broadcast_two_versions(engine, loop.run_until_complete, folder, model, prompts, (1, 2))
    finally:
        loop.run_until_complete(engine.close())
        loop.close()


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in parents.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_launcher_with_sglang_backend_survives_kill_9_of_a_worker(setup, tmp_path):
    """The real launcher, two inference workers each with its own SGLang server: kill -9 of one worker takes its
    server down with it, its requests go to the other worker, and the run finishes its steps with exit 0."""
    import json
    import signal
    import subprocess
    import sys
    import time

    main_python = os.environ.get("ARL_MAIN_PYTHON", "")
    assert main_python and os.access(main_python, os.X_OK), (
        f"ARL_MAIN_PYTHON={main_python!r} is not an executable python; scripts/test_sglang_cpu.sh sets it to the "
        "project's venv python (with DeepSpeed)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_dir = str(tmp_path / "runs" / "run")
    steps = 4
    cmd = [main_python, os.path.join(root, "training", "main_async_ppo.py"), f"run_dir={tmp_path / 'runs'}",
           "run_name=run", f"model.path={setup['base']}", f"total_train_steps={steps}",
           "inference.backend=sglang", f"inference.sglang.python={sys.executable}", "inference.num_workers=2",
           "learner.batch_size=2", "agent.group_size=4", "rollout.max_concurrent_rollouts=8", "eval.max_prompts=16",
           "eval.every_n_steps=0", "progress=false", "startup_timeout=400",
           "agent.args.filter_uniform_groups=false"]  # random weights: every group is all-wrong; keep them
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")

    def records() -> list[dict]:
        try:
            with open(metrics) as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    try:
        deadline = time.monotonic() + 600
        while not any(m["type"] == "train" for m in records()):
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "no training step in 600 s"
            time.sleep(0.5)
        victim = None
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        argv = f.read().decode(errors="replace").split("\0")
                except OSError:
                    continue
                if "arl.launch.role" in argv and run_dir in argv and "inference" in argv and "1" in argv \
                        and argv[argv.index("--index") + 1] == "1":
                    victim = int(d)
        assert victim is not None
        server_tree = _children(victim)
        assert server_tree, "the inference worker has no SGLang server child"
        os.kill(victim, signal.SIGKILL)
        end = time.monotonic() + 60
        while any(_alive(p) for p in server_tree) and time.monotonic() < end:
            time.sleep(0.2)
        assert not any(_alive(p) for p in server_tree), "the SGLang server outlived its worker"
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    recs = records()
    assert [m["step"] for m in recs if m["type"] == "train"] == list(range(1, steps + 1))
    assert [m["servers"] for m in recs if m["type"] == "worker_lost"] == [[1]]
    last_eval = [m for m in recs if m["type"] == "eval"][-1]
    assert last_eval["version"] == steps and last_eval["token_versions"] == [steps, steps]


def test_qwen2_tool_folder_turns_equal_the_embedded_engine(tmp_path):
    """The real-model path's folder (`arl.models.qwen2_tiny`, as tests/e2e/test_real_model_path.py builds it):
    SGLang loads it as it is (Qwen2Tokenizer through AutoTokenizer, Qwen2 weights, a generation config with two
    eos ids), and its greedy turns of the gsm8k tool conversation equal the embedded engine's, stop tokens
    included: the tool call ends on <|im_end|>, the answer after the calculator's observation on <|endoftext|>."""
    from arl.api.types import GenerateRequest, GenerationConfig
    from arl.config import SGLangConfig
    from arl.inference.sglang_engine import launch_sglang_engine
    from arl.inference.torch_engine import TorchEngine
    from arl.models.qwen2_tiny import build_qwen2_tiny_dir
    from arl.recipes.tool_demo import _demo_sequences
    from experiments.gsm8k import gsm8k_tool_demo
    from arl.models.tiny import load_model_dir, stop_token_ids

    demo = gsm8k_tool_demo()
    folder = build_qwen2_tiny_dir(str(tmp_path / "qwen2"), demo=demo)
    model, tok = load_model_dir(folder)
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    prompts = []
    for ids, mask in _demo_sequences(tok, demo):  # turn 1 (the prompt) and turn 2 (prompt + call + observation)
        first = mask.index(1)
        second = first + mask[first:].index(0)
        prompts += [ids[:first], ids[:second + mask[second:].index(1)]]

    def requests() -> list:
        return [GenerateRequest(qid=str(i), input_ids=np.asarray(p, np.int32),
                                gconfig=GenerationConfig(greedy=True, max_new_tokens=48))
                for i, p in enumerate(prompts)]

    async def torch_turns():
        engine = TorchEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=stop_token_ids(folder),
                             max_batch_size=16, max_context_len=1024)
        rs = await asyncio.gather(*(engine.agenerate(r) for r in requests()))
        await engine.close()
        return rs

    loop = asyncio.new_event_loop()
    engine = launch_sglang_engine(SGLangConfig(startup_timeout=300), model_path=folder, device="cpu", seed=0,
                                  name="sgl-qwen2", run_dir=str(tmp_path / "run"), max_batch_size=16,
                                  max_context_len=1024, health_interval=5)
    async def sglang_turns():
        return await asyncio.gather(*(engine.agenerate(r) for r in requests()))

    try:
        got = loop.run_until_complete(sglang_turns())
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    ref = asyncio.run(torch_turns())
    ends = []
    for g, r in zip(got, ref):
        assert g.error is None and r.error is None, (g.error, r.error)
        gs, rs = g.samples[0], r.samples[0]
        assert gs.output_ids.tolist() == rs.output_ids.tolist(), tok.decode(rs.output_ids.tolist())
        assert gs.finish_reason == rs.finish_reason
        ends.append(int(rs.output_ids[-1]) if rs.finish_reason == "stop" else None)
    assert im_end in ends[0::2] and eot in ends[1::2], ends  # both eos ids ended some turn
