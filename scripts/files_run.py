"""Which files of `arl/` run code in each process of a short run: the measurement behind docs/architecture.md's
count of the files one prompt passes.

    python scripts/files_run.py [key=value ...]    # default: the default experiment, 2 steps

It runs the entry point under coverage.py (`pip install coverage`; every role process measured too) and, per
process, lists the files in which some function body ran (a module that was only imported does not count).
"""

from __future__ import annotations

import ast
import glob
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_level_lines(path: str) -> set[int]:
    """Lines that run at import: module and class bodies (a def's own line included), not function bodies."""
    tree = ast.parse(open(path).read())
    lines: set[int] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            end = node.end_lineno or node.lineno
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                lines.update(range(start, node.body[0].lineno))
                for a in node.args.defaults + node.args.kw_defaults:
                    if a is not None:
                        lines.update(range(a.lineno, (a.end_lineno or a.lineno) + 1))
            elif isinstance(node, ast.ClassDef):
                lines.update(range(min([d.lineno for d in node.decorator_list] + [node.lineno]), node.body[0].lineno))
                visit(node.body)
            else:
                lines.update(range(node.lineno, end + 1))

    visit(tree.body)
    return lines


def ran(data_file: str) -> list[str]:
    import coverage

    data = coverage.CoverageData(basename=data_file)
    data.read()
    out = []
    for f in data.measured_files():
        executed = set(data.lines(f) or [])
        if executed - module_level_lines(f):
            out.append(os.path.relpath(f, ROOT))
    return sorted(out)


def main(argv: list[str]) -> int:
    tmp = tempfile.mkdtemp(prefix="arl-files-run-")
    rc = os.path.join(tmp, ".coveragerc")
    with open(rc, "w") as f:
        f.write(f"[run]\npatch = subprocess\nparallel = True\nsource = {os.path.join(ROOT, 'arl')}\n"
                f"data_file = {os.path.join(tmp, '.coverage')}\n")
    args = argv or ["total_train_steps=2"]
    cmd = [sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", os.path.join(ROOT, "training", "main_async_ppo.py"),
           f"run_dir={os.path.join(tmp, 'runs')}", "progress=false", *args]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, "COVERAGE_RCFILE": rc}, check=True, stdout=subprocess.DEVNULL)
    union: set[str] = set()
    for data_file in sorted(glob.glob(os.path.join(tmp, ".coverage.*"))):
        files = ran(data_file)
        union.update(files)
        roles = [f for f in files if f.endswith("/entry.py") or f.endswith("launch/run.py")]
        print(f"{os.path.basename(data_file)} ({', '.join(roles) or '?'}): {len(files)} files")
        print("  " + " ".join(files))
    print(f"all processes: {len(union)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
