"""How big `arl/` is at a git revision, in Python statements: the figure issue 12 ("arl/ is smaller than before")
is judged by, reproducible from the repository alone.

Statements, not lines, so formatting does not move the figure. Docstrings are counted apart (`code` excludes
them): documentation is wanted, and a cut must not be a deleted docstring.

    python scripts/code_size.py                      # HEAD
    python scripts/code_size.py 8c8151e HEAD         # side by side
    python scripts/code_size.py HEAD --exclude arl/weights/,arl/report/ --files
    python scripts/code_size.py --history 8c8151e    # what each commit on main since 8c8151e added or removed
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def count(source: str) -> tuple[int, int]:
    """(statements, of which docstrings) of one module's source."""
    statements = docstrings = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt):
            statements += 1
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value,
                                                                                                  str):
                docstrings += 1
    return statements, docstrings


def sizes(rev: str, exclude: list[str], repo: Path = ROOT) -> dict[str, tuple[int, int]]:
    """Path -> (statements, docstrings) of every .py file under arl/ at `rev`, less the `exclude` prefixes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout

    files = [f for f in git("ls-tree", "-r", "--name-only", rev, "arl/").split()
             if f.endswith(".py") and not any(f.startswith(e) for e in exclude)]
    return {f: count(git("show", f"{rev}:{f}")) for f in files}


def history(start: str, exclude: list[str], repo: Path = ROOT) -> list[tuple[str, int, str]]:
    """(commit, code statements, subject) of `start` and of each first-parent commit after it up to HEAD: on main,
    a merge's row is what the whole branch it merged added or removed, so each change is seen once."""
    def log(*revs: str) -> list[str]:
        return subprocess.run(["git", "-C", str(repo), "log", "--first-parent", "--reverse", "--format=%h %s", *revs],
                              check=True, capture_output=True, text=True).stdout.splitlines()

    rows = []
    for line in log("-1", start) + log(f"{start}..HEAD"):
        commit, _, subject = line.partition(" ")
        rows.append((commit, sum(s - d for s, d in sizes(commit, exclude, repo).values()), subject))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revs", nargs="*", default=["HEAD"], help="git revisions (default HEAD)")
    ap.add_argument("--exclude", default="", help="comma-separated path prefixes left out (e.g. arl/weights/)")
    ap.add_argument("--files", action="store_true", help="one line per file too")
    ap.add_argument("--history", metavar="REV", help="code statements after each first-parent commit since REV")
    args = ap.parse_args(argv)
    exclude = [e for e in args.exclude.split(",") if e]
    if args.history:
        prev = None
        for commit, code, subject in history(args.history, exclude):
            delta = "" if prev is None else f"{code - prev:+d}"
            print(f"{commit:<12} {code:>7} {delta:>6}  {subject[:100]}")
            prev = code
        return
    print(f"{'revision':<12} {'files':>6} {'statements':>11} {'docstrings':>11} {'code':>7}")
    for rev in args.revs:
        per_file = sizes(rev, exclude)
        if args.files:
            for f, (s, d) in sorted(per_file.items()):
                print(f"  {f:<44} {s:>11} {d:>11} {s - d:>7}")
        total = sum(s for s, _ in per_file.values())
        docs = sum(d for _, d in per_file.values())
        print(f"{rev:<12} {len(per_file):>6} {total:>11} {docs:>11} {total - docs:>7}")


if __name__ == "__main__":
    main()
