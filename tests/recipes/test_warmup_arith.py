import json
import os
import time

import pytest
import torch

from arl.agents.common import encode_chat, row_messages
from arl.data import make_arith_splits
from arl.models.tiny import build_char_tokenizer, build_tiny_model, load_model_dir
from arl.recipes.sft import MARKER, greedy_generate
from arl.recipes.warmup_arith import encode_sft_row, get_warm_model, greedy_accuracy

torch.set_num_threads(1)


def test_sft_row_and_padded_greedy_equals_unpadded():
    tok = build_char_tokenizer()
    prompt, target = encode_sft_row(tok, {"id": "1+2", "prompt": "1+2=", "answer": "3"})
    assert tok.decode(prompt) == "<|user|>1+2=<|assistant|>" and tok.decode(target) == "3<eos>"
    model = build_tiny_model(len(tok), seed=3)
    _, test = make_arith_splits(test_size=20)
    prompts = [encode_chat(tok, row_messages(r)) for r in test[:6]] + [encode_chat(tok, [{"role": "user", "content": "1+1="}])]
    batched = greedy_generate(model, prompts, 4, tok.eos_token_id, tok.pad_token_id)
    single = [greedy_generate(model, [p], 4, tok.eos_token_id, tok.pad_token_id)[0] for p in prompts]
    assert batched == single
    assert 0.0 <= greedy_accuracy(model, tok, test) <= 1.0


def test_cache_marker_and_crashed_build(tmp_path):
    kw = dict(max_steps=2, eval_every=1, target_acc=1.0, test_size=20, max_operand=9)
    first = get_warm_model(str(tmp_path), **kw)
    # a folder without the marker (a crashed build) is rebuilt, not reused
    os.remove(os.path.join(first, MARKER))
    again = get_warm_model(str(tmp_path), **kw)
    assert again == first and os.path.exists(os.path.join(again, MARKER))
    info = json.load(open(os.path.join(again, "warmup.json")))
    assert info["steps"] == 2 and info["reached_target"] is False
    t0 = time.perf_counter()
    assert get_warm_model(str(tmp_path), **kw) == again  # cached: no retraining
    assert time.perf_counter() - t0 < 0.5
    assert get_warm_model(str(tmp_path), **{**kw, "seed": 1}) != again  # settings change the hash
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_warmup_reaches_target(tmp_path):
    path = get_warm_model(str(tmp_path), seed=0)
    info = json.load(open(os.path.join(path, "warmup.json")))
    assert info["reached_target"] and info["accuracy"] >= 0.30, info
    assert info["steps"] <= 400
    model, tok = load_model_dir(path)
    _, test = make_arith_splits()
    assert greedy_accuracy(model, tok, test) == pytest.approx(info["accuracy"])
