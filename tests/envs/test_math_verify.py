"""math-verify reward on boxed, fraction and LaTeX answers; answer extraction on GSM8K/MATH formats."""

import asyncio
import os
import time

import pytest

from arl.data.jsonl import load_jsonl
from arl.envs.math import MathEnv
from arl.envs.math_verify import MathVerifier, extract_answer, extract_boxed, gold_answer, verify_answer

SAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "arl", "data", "samples")


def test_extract_answer_formats():
    assert extract_boxed(r"so $\boxed{\frac{5}{6}}$.") == r"\frac{5}{6}"
    assert extract_boxed(r"\boxed{a} then \boxed{\left(\frac{2}{3}\right)^{2}}") == r"\left(\frac{2}{3}\right)^{2}"
    assert extract_boxed(r"\boxed{unclosed") is None and extract_boxed("none") is None
    assert extract_answer("He has 42 - 30 = <<42-30=12>>12 left.\n#### 12") == "12"
    assert extract_answer("#### 1,050") == "1050"
    assert extract_answer("The answer is 7.5.") == "7.5"
    assert extract_answer("The answer is: $\\frac{3}{4}$") == "\\frac{3}{4}"
    assert extract_answer("first 3 then 3/4") == "3/4"
    assert extract_answer("no numbers") is None and extract_answer("") is None
    assert gold_answer("blah\n#### 72") == "72" and gold_answer(" 5 ") == "5"


def test_extraction_on_the_shipped_samples():
    rows = load_jsonl(os.path.join(SAMPLES, "gsm8k_sample.jsonl")) + load_jsonl(os.path.join(SAMPLES,
                                                                                          "math_sample.jsonl"))
    assert len(rows) == 16
    for r in rows:
        got = extract_answer(r["solution"])
        assert got is not None and got.replace("\\dfrac", "\\frac") == r["answer"], (r["id"], got)


def test_verify_boxed_fraction_latex_and_gsm8k():
    yes = [
        (r"The answer is $\boxed{\frac12}$", r"\frac{1}{2}"),
        ("0.5", r"\frac{1}{2}"),
        (r"\boxed{\dfrac{1}{2}}", "1/2"),
        (r"$\frac{\sqrt{2}}{2}$", r"\sqrt{2}/2"),
        (r"\boxed{3 \pi}", r"3\pi"),
        (r"so $x = \boxed{4}$.", "4"),
        ("Altogether she sold 48+24 = 72 clips. #### 72", "72"),
        ("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18", "Some solution text\n#### 18"),
        ("1000", "1,000"),
        (r"$\boxed{5\sqrt{2}}$", r"5\sqrt{2}"),
    ]
    no = [("The answer is 11", "10"), (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}"), ("I don't know", "3")]
    for pred, gold in yes:
        assert verify_answer(pred, gold) == 1.0, (pred, gold)
    for pred, gold in no:
        assert verify_answer(pred, gold) == 0.0, (pred, gold)
    with pytest.raises(ValueError):
        verify_answer("1", "")


def sleepy(completion, answer, rounding):  # runs in the pool (imported there by name)
    time.sleep(float(completion))
    return 1.0


@pytest.mark.slow
def test_process_pool_reward_with_timeout_through_math_env():
    v = MathVerifier(max_workers=1, task_timeout=20.0)
    try:
        assert v.check(r"\boxed{\frac{5}{6}}", r"\frac{5}{6}") == 1.0
        assert v.check("7", "6") == 0.0
    finally:
        v.close()
    slow = MathVerifier(max_workers=1, task_timeout=0.5, fn=sleepy)
    try:
        assert slow.check("0", "x") == 1.0  # the first check starts the pool
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            slow.check("30", "x")
        assert time.monotonic() - t0 < 10 and slow.stats["restarts"] == 1
        assert slow.check("0", "x") == 1.0  # a fresh pool took over
    finally:
        slow.close()

    async def env_step():
        env = MathEnv(reward_fn="arl.envs.math_verify:math_verify_reward", timeout=60)
        await env.reset(options={"answer": r"\frac{3}{4}"})
        return await env.step(r"It is $\boxed{0.75}$")

    _, reward, done, _, info = asyncio.run(env_step())
    assert reward == 1.0 and done and info["error"] is None
