"""HuggingFace datasets on disk (save_to_disk, parquet) and the word-problem task."""

import json
import os

import pytest

from arl.data.splits import load_splits
from arl.data.word_problems import make_word_problem_splits
from arl.tools.calculator import calculate

SAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "arl", "data", "samples")


def test_word_problems_are_consistent_and_disjoint():
    train, test = make_word_problem_splits(n_train=300, test_size=50, seed=3)
    assert len(train) == 300 and len(test) == 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for r in train + test:
        assert calculate(r["expression"]) == r["answer"]
    assert make_word_problem_splits(n_train=300, test_size=50, seed=3) == (train, test)
    tr, te = load_splits(name="word-arith", test_size=20)
    assert len(te) == 20 and len(tr) > 1000


def test_load_from_save_to_disk_and_parquet(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [json.loads(line) for line in open(os.path.join(SAMPLES, "gsm8k_sample.jsonl"))]
    gsm = datasets.Dataset.from_list([{"question": r["prompt"], "answer": r["solution"]} for r in rows])
    dd = datasets.DatasetDict({"train": gsm, "test": gsm.select(range(2))})
    dd.save_to_disk(str(tmp_path / "gsm"))
    train, test = load_splits(name="hf", train_path=str(tmp_path / "gsm"), test_path=str(tmp_path / "gsm"))
    assert len(train) == 8 and len(test) == 2
    assert train[0]["prompt"] == rows[0]["prompt"] and train[0]["answer"] == "12" and "####" in train[0]["solution"]
    math_rows = [json.loads(line) for line in open(os.path.join(SAMPLES, "math_sample.jsonl"))]
    mds = datasets.Dataset.from_list([{"problem": r["prompt"], "solution": r["solution"], "id": r["id"]}
                                      for r in math_rows])
    mds.to_parquet(str(tmp_path / "math.parquet"))
    train, _ = load_splits(name="hf", train_path=str(tmp_path / "math.parquet"))
    assert [r["answer"].replace("\\dfrac", "\\frac") for r in train] == [r["answer"] for r in math_rows]
    assert train[0]["id"] == "math-0"
    chat = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}])
    chat.to_parquet(str(tmp_path / "chat.parquet"))
    (row,) = load_splits(name="hf", train_path=str(tmp_path / "chat.parquet"))[0]
    assert row["messages"] == [{"role": "user", "content": "1+1="}] and row["answer"] == "2"
    with pytest.raises(ValueError, match="prompt column"):
        load_splits(name="hf", train_path=str(tmp_path / "chat.parquet"), prompt_field="nope")
    with pytest.raises(FileNotFoundError):
        load_splits(name="hf", train_path=str(tmp_path / "missing.parquet"))
