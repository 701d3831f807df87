"""Token ledger check: every trajectory the learner gets is exactly the engine's tokens plus the tokens the agent
inserted, each with its source; any drift (a re-tokenised turn, an edited token, a logprob or version that is
not the engine's, a context the engine never saw) fails loudly.

`TrajectoryBuilder` writes `metadata["token_ledger"] = [[source, start, end], ...]` (source "engine" for a sample
added with `add_generated`, else the name given to `add_context`: "prompt", "observation:calculator", ...).
The rollout worker records every (request, response) that went through an agent's queues in an `EngineLog`;
`verify_trajectory` then checks:

- the segments tile the trajectory (contiguous, from 0 to its length), each with a non-empty source;
- every "engine" segment equals, token for token, a sample the engine returned for a request whose input ids
  are exactly the trajectory's tokens before the segment (so the context the learner sees is the one the
  engine generated from), with the engine's logprobs and versions wherever loss_mask is 1;
- every inserted segment has loss_mask 0 (so the learner never trains on a token the model did not generate).
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import numpy as np

from arl.api.types import GenerateRequest, GenerateResponse, SampleOutput, Trajectory

__all__ = ["TokenLedgerError", "EngineLog", "verify_trajectory"]


class TokenLedgerError(RuntimeError):
    """What the learner would train on is not what the engine produced plus declared insertions."""


class EngineLog:
    """The (request input ids, sample) pairs one agent run received, indexed by the sample's token bytes."""

    def __init__(self) -> None:
        self._by_tokens: dict[bytes, list[tuple[np.ndarray, SampleOutput]]] = collections.defaultdict(list)
        self.n_samples = 0

    def add(self, req: GenerateRequest, resp: GenerateResponse) -> None:
        if resp.error is not None:
            return
        for s in resp.samples:
            self._by_tokens[s.output_ids.tobytes()].append((req.input_ids, s))
            self.n_samples += 1

    def candidates(self, ids: np.ndarray) -> list[tuple[np.ndarray, SampleOutput]]:
        return self._by_tokens.get(np.ascontiguousarray(ids, dtype=np.int32).tobytes(), [])


def _fail(t: Trajectory, msg: str) -> TokenLedgerError:
    return TokenLedgerError(f"token ledger check failed for trajectory of group {t.group_id!r} "
                            f"(prompt {t.metadata.get('prompt_id')!r}): {msg}")


def verify_trajectory(t: Trajectory, log: EngineLog) -> dict[str, int]:
    """Raise TokenLedgerError on any drift; returns token counts by source."""
    ledger: Optional[Any] = t.metadata.get("token_ledger")
    if not isinstance(ledger, list) or not ledger:
        raise _fail(t, "metadata has no 'token_ledger' (build trajectories with TrajectoryBuilder, which records "
                       "where every token came from)")
    n = len(t.input_ids)
    pos = 0
    counts: collections.Counter = collections.Counter()
    mask = t.loss_mask.astype(bool)
    for i, entry in enumerate(ledger):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], str) and entry[0]):
            raise _fail(t, f"ledger entry {i} is malformed: {entry!r}")
        source, a, b = entry[0], int(entry[1]), int(entry[2])
        if a != pos or b < a or b > n:
            raise _fail(t, f"ledger entry {i} {entry!r} does not continue at token {pos} (length {n})")
        pos = b
        counts[source if source == "engine" else source.split(":")[0]] += b - a
        seg = t.input_ids[a:b]
        if source != "engine":
            if mask[a:b].any():
                raise _fail(t, f"inserted tokens {a}:{b} ({source!r}) have loss_mask 1: the learner would train on "
                               "tokens the model did not generate")
            continue
        reasons = []
        for req_ids, s in log.candidates(seg):
            if len(req_ids) != a or not np.array_equal(req_ids, t.input_ids[:a]):
                reasons.append("the engine generated these tokens from a different context")
                continue
            m = mask[a:b]
            if not np.array_equal(s.output_logprobs[m], t.logprobs[a:b][m]):
                reasons.append("behaviour logprobs differ from the engine's")
                continue
            if not np.array_equal(s.output_versions[m], t.versions[a:b][m]):
                reasons.append("token versions differ from the engine's")
                continue
            break  # a sample the engine returned matches
        else:
            why = "; ".join(sorted(set(reasons))) or "no sample the engine returned has exactly these tokens"
            raise _fail(t, f"engine segment {a}:{b} ({b - a} tokens): {why}")
    if pos != n:
        raise _fail(t, f"the ledger covers {pos} of {n} tokens")
    return dict(counts)
