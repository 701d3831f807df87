#!/usr/bin/env bash
# Creates .venv and installs ARL with its dev extras. On CPU machines torch is pinned through
# constraints-cpu.txt (an unpinned torch pulls a multi-GB CUDA build); setup.py itself stays open for GPU users.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
CONSTRAINTS=${ARL_CONSTRAINTS:-constraints-cpu.txt}
pip install -q --disable-pip-version-check -c "$CONSTRAINTS" torch
pip install -q --disable-pip-version-check -c "$CONSTRAINTS" -e ".[dev]"
