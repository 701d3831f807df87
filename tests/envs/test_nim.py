"""Nim, the self-play game: the referee's rules, move parsing and the optimal move."""

import pytest

from arl.envs.nim import NimEnv, optimal_move, parse_move, pile_of


@pytest.mark.asyncio
async def test_a_game_to_its_end_and_who_won():
    env = NimEnv()
    obs, info = await env.reset(options={"pile": 6})
    assert obs == "pile 6" and info["to_move"] == 0 and info["winner"] is None
    obs, r, done, _, info = await env.step("2<eos>")
    assert (obs, r, done, info["to_move"], info["take"]) == ("pile 4", 0.0, False, 1, 2)
    obs, r, done, _, info = await env.step("3")
    assert (obs, done, info["to_move"]) == ("pile 1", False, 0)
    obs, r, done, _, info = await env.step("1")
    assert (r, done, info["winner"], info["correct"]) == (1.0, True, 0, True)
    with pytest.raises(RuntimeError, match="after the game ended"):
        await env.step("1")


@pytest.mark.asyncio
@pytest.mark.parametrize("move", ["4", "0", "x", "", "2"])
async def test_an_illegal_move_loses_at_once(move):
    env = NimEnv(max_take=3)
    await env.reset(options={"pile": 1})  # 2 is more than is left
    _, r, done, _, info = await env.step(move)
    assert done and r == 0.0 and info["illegal"] and info["winner"] == 1


@pytest.mark.asyncio
async def test_the_pile_comes_from_an_env_seeds_row():
    env = NimEnv(min_pile=5, max_pile=20)
    piles = [(await env.reset(options={"seed": s}))[1]["pile"] for s in range(1_000_000, 1_000_032)]
    assert sorted(set(piles)) == list(range(5, 21)) and piles[0] == piles[1]  # two seeds (two seat orders) a pile
    assert pile_of(7, 5, 20) == 8
    with pytest.raises(ValueError, match="needs options"):
        await env.reset(options={})
    with pytest.raises(ValueError, match="max_pile"):
        NimEnv(min_pile=9, max_pile=3)


def test_parse_and_optimal_moves():
    assert parse_move("take 3 now", 9, 3) == 3 and parse_move("1234", 9, 3) is None
    assert parse_move("<|assistant|>2", 9, 3) == 2
    assert [optimal_move(p) for p in (4, 5, 6, 7, 8)] == [None, 1, 2, 3, None]
