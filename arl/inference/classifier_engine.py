"""A judge worker's engine for a sequence-classification reward model (`judge.mode=classifier`).

It answers the same `gen_req` as a generating engine, so the judge workers reuse the inference worker, its socket
and the rollout side's `InferenceClient` unchanged: the request's prompt is the text to score, and the answer is
one sample of one token (the tokenizer's eos) whose logprob slot carries the head's score (`arl.envs.judge.score_of`
reads it). Only the torch backend serves it (an SGLang server exposes no classification head here);
`arl.config.judge_problems` refuses the other combinations at start-up.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from arl.api.types import GenerateRequest, GenerateResponse, SampleOutput
from arl.inference.requests import check_request, refusal


class ClassifierEngine:
    """Scores one request at a time in a worker thread (a judge worker's load is a few texts per env step)."""

    def __init__(self, model_path: str, *, device: str = "cpu", max_context_len: int = 2048,
                 dtype: Any = None) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=dtype or torch.float32)
        if self.model.config.pad_token_id is None:  # batch-of-one scoring still needs it to find the last token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id or 0
        self.model.to(device).eval()
        self.device, self.max_context_len = device, max_context_len
        self.vocab_size = int(self.model.config.vocab_size)
        self.eos = int(self.tokenizer.eos_token_id or 0)
        self.version = 0  # frozen: never updated
        self._lock = asyncio.Lock()
        self.counts = {"scored": 0, "refused": 0, "score_ms_total": 0.0}

    def score_ids(self, ids: np.ndarray) -> float:
        """The head's score of one token sequence (label 0 of a one-label head, the last label otherwise)."""
        import torch

        with torch.inference_mode():
            x = torch.as_tensor(np.asarray(ids, dtype=np.int64)[None], device=self.device)
            logits = self.model(input_ids=x).logits[0]
        return float(logits[0] if logits.numel() == 1 else logits[-1])

    async def agenerate(self, req: GenerateRequest) -> GenerateResponse:
        err = check_request(req, max_context_len=self.max_context_len, vocab_size=self.vocab_size)
        if err is not None:
            self.counts["refused"] += 1
            return refusal(req, err)
        t0 = time.perf_counter()
        async with self._lock:
            score = await asyncio.to_thread(self.score_ids, req.input_ids)
        self.counts["scored"] += 1
        self.counts["score_ms_total"] += (time.perf_counter() - t0) * 1000
        sample = SampleOutput(output_ids=[self.eos], output_logprobs=[score], output_versions=[0],
                              finish_reason="stop")
        return GenerateResponse(qid=req.qid, samples=[sample])

    async def update_weights(self, source: str, version: int) -> None:
        raise RuntimeError("a judge model is frozen: it takes no weight updates")

    async def pause(self) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return dict(self.counts)
