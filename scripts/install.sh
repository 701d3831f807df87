#!/usr/bin/env bash
# Creates .venv and installs ARL: the base package for the main job (`bash scripts/install.sh`), plus the extras
# named as arguments (`bash scripts/install.sh dev` for the test suite: pytest, Ray, trackers, datasets). On CPU
# machines torch is pinned through constraints-cpu.txt (an unpinned torch pulls a multi-GB CUDA build); setup.py
# itself stays open for GPU users.
#
# The packages go in with uv (bootstrapped from PyPI into the venv, ~4 s) when it can be had: it resolves and
# unpacks in parallel. It is given pip's own configuration (index URLs, find-links, constraint files, CA file) so it
# sees the same packages pip would. The base install (the main job) does not byte-compile all of site-packages as
# pip does (torch alone is ~10k files, most never imported): scripts/warm_bytecode.py writes the bytecode of what
# the roles import; with extras (the test suite imports far more) everything is compiled, as pip would.
# ARL_INSTALLER=pip forces plain pip; plain pip is also the fallback when uv cannot be installed or fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
CONSTRAINTS=${ARL_CONSTRAINTS:-constraints-cpu.txt}
extras=$(IFS=,; echo "$*")
target=".${extras:+[$extras]}"

with_pip() {
    pip install -q --disable-pip-version-check -c "$CONSTRAINTS" torch
    pip install -q --disable-pip-version-check -c "$CONSTRAINTS" -e "$target"
}

. scripts/uv_install.sh

with_uv() {
    local args=(-c "$CONSTRAINTS")
    [ -z "$extras" ] || args+=(--compile-bytecode)
    uv_install .venv/bin/python "${args[@]}" torch -e "$target" || return 1
    [ -n "$extras" ] || .venv/bin/python scripts/warm_bytecode.py
}

if ! with_uv; then
    [ "${ARL_INSTALLER:-uv}" = pip ] || echo "[install] uv was not available or failed; installing with pip" >&2
    with_pip
fi
