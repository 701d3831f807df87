"""Nim, a two-player text game for self-play (registered as env "nim").

One pile of `pile` stones; the players take turns, each taking 1 to `max_take` stones (never more than are left);
whoever takes the last stone wins. The player to move sees `"pile N"` and answers with a number. A move that is
not a number in range ends the game: the one who made it loses (so legality is learned from the same reward).
Optimal play takes `pile % (max_take + 1)` stones whenever that is not 0: a rule a policy can find by playing.

    env = NimEnv(min_pile=5, max_pile=20)
    obs, info = await env.reset(options={"seed": 7})      # "pile 12", {"pile": 12, "to_move": 0}
    obs, reward, done, _, info = await env.step("3")       # "pile 9", 0.0, False, {"to_move": 1, ...}

The env is the referee: `info["to_move"]` says which seat (0 or 1) plays next, `info["winner"]` who won once
`done`, and `info["move_stats"]` how good the move was (`winning_chances`: a winning move existed,
`winning_moves`: it was taken), which the self-play agent sums per seat into the trajectory's metadata. The reward of a step is the mover's: 1.0 for the winning move, else 0.0; agents credit each seat from
`winner` (`arl.agents.self_play`). The starting pile comes from the row: `options["pile"]`, else `options["seed"]`
(the `env-seeds` dataset's rows): `min_pile + (seed // 2) % (max_pile - min_pile + 1)`, so consecutive seeds
share a pile and differ in parity, which the self-play agent's evaluation uses to alternate who moves first.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from arl.api import EnvironmentService, register_env
from arl.envs.math import SPECIAL_TOKENS

_MOVE_RE = re.compile(r"\d+")


def pile_of(seed: int, min_pile: int, max_pile: int) -> int:
    return min_pile + (int(seed) // 2) % (max_pile - min_pile + 1)


def parse_move(text: str, pile: int, max_take: int) -> Optional[int]:
    """The move `text` states (its first number) if legal for `pile`, else None."""
    m = _MOVE_RE.search(SPECIAL_TOKENS.sub("", text))
    if m is None or len(m.group()) > 3:
        return None
    take = int(m.group())
    return take if 1 <= take <= min(max_take, pile) else None


def optimal_move(pile: int, max_take: int = 3) -> Optional[int]:
    """The winning move from `pile` (None: every move loses against optimal play)."""
    take = pile % (max_take + 1)
    return take or None


class NimEnv(EnvironmentService):
    def __init__(self, min_pile: int = 5, max_pile: int = 20, max_take: int = 3) -> None:
        for name, v in (("min_pile", min_pile), ("max_pile", max_pile), ("max_take", max_take)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"nim: {name} must be an int >= 1, got {v!r}")
        if max_pile < min_pile:
            raise ValueError(f"nim: max_pile ({max_pile}) must be >= min_pile ({min_pile})")
        self.min_pile, self.max_pile, self.max_take = min_pile, max_pile, max_take
        self.pile = 0
        self.to_move = 0
        self.winner: Optional[int] = None

    def _info(self, **more: Any) -> dict[str, Any]:
        return {"pile": self.pile, "to_move": self.to_move, "winner": self.winner, **more}

    async def reset(self, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None) -> tuple[str, dict]:
        options = options or {}
        if options.get("pile") is not None:
            pile = int(options["pile"])
        elif options.get("seed") is not None:
            pile = pile_of(int(options["seed"]), self.min_pile, self.max_pile)
        else:
            raise ValueError("nim: reset needs options['pile'] or options['seed'] (an env-seeds row)")
        if pile < 1:
            raise ValueError(f"nim: the pile must be >= 1, got {pile}")
        self.pile, self.to_move, self.winner = pile, 0, None
        return self.observation(), self._info()

    def observation(self) -> str:
        return f"pile {self.pile}"

    async def step(self, action: Any) -> tuple[str, float, bool, bool, dict]:
        if self.winner is not None:
            raise RuntimeError("nim: step after the game ended; reset first")
        mover = self.to_move
        take = parse_move(str(action), self.pile, self.max_take)
        best = optimal_move(self.pile, self.max_take)
        # how well the mover played, whoever the opponent: a winning move existed / it was taken
        stats = {"winning_chances": int(best is not None), "winning_moves": int(best is not None and take == best)}
        if take is None:  # an illegal move loses at once
            self.winner = 1 - mover
            return self.observation(), 0.0, True, False, self._info(illegal=True, correct=False, move_stats=stats)
        self.pile -= take
        if self.pile == 0:
            self.winner = mover
            return self.observation(), 1.0, True, False, self._info(take=take, correct=True, move_stats=stats)
        self.to_move = 1 - mover
        return self.observation(), 0.0, False, False, self._info(take=take, correct=False, move_stats=stats)


register_env("nim", NimEnv)
