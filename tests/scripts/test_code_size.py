"""scripts/code_size.py counts statements and tells docstrings apart, on a throwaway git repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

from scripts.code_size import count, history, main, sizes

MODULE = '''"""Module doc."""
import os


def f(x):
    """Function doc."""
    if x:
        return os.sep
    return ""
'''


def test_count_separates_docstrings_from_code() -> None:
    # import, def, if, return, return + two docstrings
    assert count(MODULE) == (7, 2)
    assert count("") == (0, 0)


def test_sizes_reads_a_revision_and_leaves_out_excluded_prefixes(tmp_path: Path, capsys) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "arl" / "sub").mkdir(parents=True)
    (tmp_path / "arl" / "a.py").write_text(MODULE)
    (tmp_path / "arl" / "sub" / "b.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "arl" / "notes.txt").write_text("not python")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    first = git("rev-parse", "HEAD")
    (tmp_path / "arl" / "sub" / "b.py").write_text("x = 1\n")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")

    assert sizes(first, [], tmp_path) == {"arl/a.py": (7, 2), "arl/sub/b.py": (2, 0)}
    assert sizes("HEAD", [], tmp_path) == {"arl/a.py": (7, 2), "arl/sub/b.py": (1, 0)}
    assert sizes("HEAD", ["arl/sub/"], tmp_path) == {"arl/a.py": (7, 2)}
    # the start and every first-parent commit after it, with its code statements (docstrings apart)
    short = [git("rev-parse", "--short", first), git("rev-parse", "--short", "HEAD")]
    assert history(first, [], tmp_path) == [(short[0], 7, "one"), (short[1], 6, "two")]


def test_main_prints_a_row_per_revision(capsys) -> None:
    main(["HEAD", "--exclude", "arl/weights/"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split() == ["revision", "files", "statements", "docstrings", "code"]
    rev, files, statements, docstrings, code = rows[1].split()
    assert rev == "HEAD" and int(files) > 50 and int(statements) - int(docstrings) == int(code) > 0
