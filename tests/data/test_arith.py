import pytest

from arl.data import make_arith_splits


def test_splits_disjoint_and_complete():
    train, test = make_arith_splits(max_operand=49, test_size=200, seed=0)
    assert len(test) == 200 and len(train) == 50 * 50 - 200
    ids_train, ids_test = {r["id"] for r in train}, {r["id"] for r in test}
    assert not ids_train & ids_test
    assert len(ids_train | ids_test) == 2500
    for r in train[:50] + test[:50]:
        a, b = map(int, r["id"].split("+"))
        assert r["prompt"] == f"{a}+{b}=" and r["answer"] == str(a + b)
    assert make_arith_splits(seed=0) == (train, test)
    assert make_arith_splits(seed=1)[1] != test


def test_bad_args():
    with pytest.raises(ValueError):
        make_arith_splits(max_operand=2, test_size=9)
