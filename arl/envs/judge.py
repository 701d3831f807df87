"""A reward from a model (registered as env "judge"): a frozen judge served by judge workers of its own.

    judge.model.path=/path/to/judge env.name=judge agent.name=env-chat [judge.mode=classifier]

The run starts `judge.inference.num_workers` judge workers (role 'judge', `arl.inference.entry.run_judge`): the
inference worker and engine of `judge.inference.backend` on `judge.model.path`, never sent weights and outside the
staleness gate. Each rollout worker reaches them through an `InferenceClient` of their own and installs a `Judge`
here (`install`); a `JudgeEnv` made in that process asks it.

- `generative`: `template` is filled with the row's question, the model's answer and the row's reference answer
  (`{question}`, `{answer}`, `{reference}`), the judge generates up to `max_new_tokens` greedily, and the first
  match of `score_regex` in its text is the score (group 1 when the pattern has a group).
- `classifier`: `classifier_template` filled the same way is scored by a sequence-classification head
  (`transformers.AutoModelForSequenceClassification`, torch backend only): the worker's answer carries the score
  in its one sample's logprob slot (`score_of`).

reward = (score - score_min) / (score_max - score_min), clipped to [0, 1]. A call that fails gives
`default_reward` and a named reason, counted in the rollout worker's `judge` counters (the run summary sums them)
and in the trajectory's metadata (so in its trace): `no_score` (no match or not a number), `timeout` (no answer
within `timeout`), `refused` (the worker answered with an error, e.g. a prompt over its context), `error`
(anything else). `step` never raises.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import math
import re
import time
from typing import Any, Awaitable, Callable, Optional

from arl.api import EnvironmentService, GenerateRequest, GenerateResponse, GenerationConfig

REASONS = ("no_score", "timeout", "refused", "error")
_ids = itertools.count()
# where a field goes in the rendered prompt, split out before encoding (NUL: in no template or chat template)
_FIELD = "\x00arl-judge-field-{}\x00"
_FIELD_RE = re.compile("\x00arl-judge-field-([0-2])\x00")


@dataclasses.dataclass(frozen=True)
class JudgeSettings:
    """What `Judge` needs of the `judge` config section (plain values: envs do not import the config)."""

    mode: str = "generative"
    template: str = "Question: {question}\nAnswer: {answer}\nReference: {reference}\nScore 0-10:"
    chat: bool = False
    score_regex: str = r"-?\d+(?:\.\d+)?"
    score_min: float = 0.0
    score_max: float = 10.0
    classifier_template: str = "{question}\n{answer}"
    max_new_tokens: int = 16
    timeout: float = 30.0
    default_reward: float = 0.0
    correct_threshold: float = 0.5


def fill(template: str, question: str, answer: str, reference: str) -> str:
    """The template with the three fields filled in (other braces must be doubled, as in str.format)."""
    return template.format(question=question, answer=answer, reference=reference)


def parse_score(text: str, pattern: re.Pattern) -> Optional[float]:
    """The first match of `pattern` in `text` as a float (its group 1 if it has groups); None if there is none."""
    m = pattern.search(text)
    if m is None:
        return None
    try:
        value = float(m.group(1) if pattern.groups else m.group(0))
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def score_of(resp: GenerateResponse) -> float:
    """The score a classifier judge worker answered with (ValueError for an answer that carries none)."""
    if resp.error is not None or len(resp.samples) != 1 or len(resp.samples[0].output_logprobs) != 1:
        raise ValueError(f"not a score answer: {resp.error or 'no single one-token sample'}")
    return float(resp.samples[0].output_logprobs[0])


class Judge:
    """Asks the judge workers for one reward per call; `generate` sends a request to them (an `InferenceClient`'s
    `generate`), `tokenizer` is the judge model's."""

    def __init__(self, generate: Callable[[GenerateRequest], Awaitable[GenerateResponse]], tokenizer: Any,
                 settings: JudgeSettings) -> None:
        self._generate, self.tokenizer, self.settings = generate, tokenizer, settings
        self.pattern = re.compile(settings.score_regex)
        stop = [int(tokenizer.eos_token_id)] if getattr(tokenizer, "eos_token_id", None) is not None else []
        self.gconfig = GenerationConfig(max_new_tokens=settings.max_new_tokens, greedy=True, stop_token_ids=stop)
        self.stats: collections.Counter = collections.Counter()  # calls, scored, failures by reason, ms

    def encode(self, template: str, question: str, answer: str, reference: str) -> list[int]:
        """The prompt's ids: the template (and chat template) encoded as usual, the three fields encoded with special
        tokens split, so an answer that spells `<|im_end|>` ... `<|im_start|>assistant` stays text and cannot open a
        judge turn of its own. The fields are encoded apart from the template and their ids concatenated."""
        text = template.format(question=_FIELD.format(0), answer=_FIELD.format(1), reference=_FIELD.format(2))
        if self.settings.chat and self.settings.mode == "generative":
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=False)
        fields = (question, answer, reference)
        ids: list[int] = []
        for i, part in enumerate(_FIELD_RE.split(text)):
            if i % 2:
                ids += self.tokenizer.encode(fields[int(part)], add_special_tokens=False, split_special_tokens=True)
            elif part:
                ids += self.tokenizer.encode(part, add_special_tokens=False)
        return ids

    def to_reward(self, score: float) -> float:
        s = self.settings
        return min(1.0, max(0.0, (score - s.score_min) / (s.score_max - s.score_min)))

    async def reward(self, question: str, answer: str, reference: str) -> tuple[float, dict[str, Any]]:
        """(reward, info): info has `judge_ms`, `judge_score` (None on a failure) and `judge_reason` (None, or
        one of REASONS) and, on a failure, `error` saying why."""
        s, t0 = self.settings, time.perf_counter()
        self.stats["judge_calls"] += 1
        score: Optional[float] = None
        reason: Optional[str] = None
        detail = ""
        try:
            template = s.template if s.mode == "generative" else s.classifier_template
            req = GenerateRequest(qid=f"judge-{next(_ids)}",
                                  input_ids=self.encode(template, question, answer, reference), gconfig=self.gconfig)
            resp = await asyncio.wait_for(self._generate(req), s.timeout)
            if resp.error is not None or not resp.samples:
                reason, detail = "refused", str(resp.error)[:300]
            elif s.mode == "classifier":
                score = score_of(resp)
            else:
                text = self.tokenizer.decode(resp.samples[0].output_ids.tolist(), skip_special_tokens=True)
                score = parse_score(text, self.pattern)
                if score is None:
                    reason, detail = "no_score", f"no score in the judge's answer {text[:200]!r}"
        except (asyncio.TimeoutError, TimeoutError):
            reason, detail = "timeout", f"no answer from the judge within {s.timeout:g}s"
        except Exception as e:  # noqa: BLE001 - a judge failure is a counted reason, never a crash of the env
            reason, detail = "error", f"{type(e).__name__}: {e}"[:300]
        ms = (time.perf_counter() - t0) * 1000
        self.stats["judge_ms_total"] += round(ms)
        if reason is not None:
            self.stats[f"judge_{reason}"] += 1
            reward = s.default_reward
        else:
            self.stats["judge_scored"] += 1
            reward = self.to_reward(float(score))
        info = {"judge_ms": round(ms, 3), "judge_score": score, "judge_reason": reason}
        if reason is not None:
            info["error"] = f"judge {reason}: {detail}"
        return reward, info


_installed: Optional[Judge] = None


def install(judge: Optional[Judge]) -> None:
    """This process's judge (the rollout worker's, set when the run has judge workers); None removes it."""
    global _installed
    _installed = judge


class JudgeEnv(EnvironmentService):
    """One question's reward from the judge: reset with a data row (its prompt and answer), step with the model's
    text; one step ends the episode."""

    def __init__(self, judge: Optional[Judge] = None) -> None:
        self.judge = judge
        self.question = self.reference = ""

    async def reset(self, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None) -> tuple[Any, dict]:
        opts = options or {}
        question = opts.get("prompt")
        if question is None and isinstance(opts.get("messages"), list) and opts["messages"]:
            question = opts["messages"][-1].get("content", "")
        self.question, self.reference = str(question or ""), str(opts.get("answer", "") or "")
        return None, {}

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        judge = self.judge or _installed
        if judge is None:
            return None, 0.0, True, False, {"correct": False, "judge_reason": "error",
                                            "error": "judge: no judge workers in this process (judge.model.path)"}
        reward, info = await judge.reward(self.question, str(action), self.reference)
        metrics = {"judge_calls": 1, "judge_ms": info["judge_ms"], "judge_failures": int(info["judge_reason"]
                                                                                          is not None)}
        return None, reward, True, False, {**info, "correct": reward >= judge.settings.correct_threshold,
                                           "metrics": metrics}
