import json

import pytest

from arl.data import load_jsonl


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_good_rows(tmp_path):
    p = _write(tmp_path / "a.jsonl", [
        json.dumps({"id": 1, "prompt": "1+1=", "answer": 2}),
        "",
        json.dumps({"id": "m", "messages": [{"role": "user", "content": "2+2="}], "answer": "4"}),
    ])
    rows = load_jsonl(p)
    assert [r["id"] for r in rows] == ["1", "m"] and rows[0]["answer"] == "2"
    assert rows[1]["messages"][0]["content"] == "2+2="


def test_bad_rows_skipped_or_raised(tmp_path):
    p = _write(tmp_path / "b.jsonl", [
        json.dumps({"id": "ok", "prompt": "1+1=", "answer": "2"}),
        json.dumps({"prompt": "no id", "answer": "1"}),
        json.dumps({"id": "x", "answer": "1"}),
        "{not json",
        json.dumps({"id": "y", "prompt": "no answer"}),
    ])
    with pytest.warns(UserWarning, match="skipped 4 bad row"):
        rows = load_jsonl(p)
    assert [r["id"] for r in rows] == ["ok"]
    with pytest.raises(ValueError, match=r"b\.jsonl:2: missing field 'id'"):
        load_jsonl(p, skip_bad_rows=False)


def test_empty_file(tmp_path):
    p = _write(tmp_path / "e.jsonl", [""])
    with pytest.raises(ValueError, match="empty"):
        load_jsonl(p)
    only_bad = _write(tmp_path / "f.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match="no usable rows"), pytest.warns(UserWarning):
        load_jsonl(only_bad)
