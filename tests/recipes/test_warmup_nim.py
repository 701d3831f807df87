"""The Nim warm-up's data (random legal games rendered as the self-play agent renders each seat's chat) and its
stopping measure (the probability of a legal first move)."""

import random

import torch

from arl.agents.common import encode_chat
from arl.envs.nim import parse_move
from arl.models.tiny import build_char_tokenizer, build_tiny_model
from arl.recipes.warmup_nim import legal_mass, random_game_chats

torch.set_num_threads(1)


def test_random_games_are_legal_and_train_only_the_moves():
    tok = build_char_tokenizer()
    rng = random.Random(0)
    for pile in (1, 2, 7, 20):
        chats = random_game_chats(tok, pile, 3, rng)
        assert tok.decode(chats[0][0]).startswith(tok.decode(encode_chat(tok, [{"role": "user",
                                                                                 "content": f"pile {pile}"}])))
        moves = []  # per seat, the trained tokens are exactly its moves and their <eos>
        for ids, mask in chats:
            trained = tok.decode([i for i, m in zip(ids, mask) if m])
            assert trained.endswith("<eos>") and "pile" not in trained
            moves.append([int(x) for x in trained.split("<eos>") if x])
        left, seat = pile, 0
        while left:  # replay: seat 0, seat 1, seat 0, ..., every move legal for what was left, the last one wins
            take = moves[seat].pop(0)
            assert parse_move(str(take), left, 3) == take
            left, seat = left - take, 1 - seat
        assert not any(moves)


def test_legal_mass_is_a_probability_and_sees_the_pile_limit():
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), seed=1).eval()
    mass = legal_mass(model, tok, max_pile=6, max_take=3)
    assert 0.0 < mass < 1.0
    assert legal_mass(model, tok, max_pile=6, max_take=9) >= mass  # more digits are legal
