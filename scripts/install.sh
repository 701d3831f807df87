#!/usr/bin/env bash
# Creates .venv and installs ARL: the base package for the main job (`bash scripts/install.sh`), plus the extras
# named as arguments (`bash scripts/install.sh dev` for the test suite: pytest, Ray, trackers, datasets). On CPU
# machines torch is pinned through constraints-cpu.txt (an unpinned torch pulls a multi-GB CUDA build); setup.py
# itself stays open for GPU users.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
CONSTRAINTS=${ARL_CONSTRAINTS:-constraints-cpu.txt}
extras=$(IFS=,; echo "$*")
pip install -q --disable-pip-version-check -c "$CONSTRAINTS" torch
pip install -q --disable-pip-version-check -c "$CONSTRAINTS" -e ".${extras:+[$extras]}"
