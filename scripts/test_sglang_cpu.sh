#!/usr/bin/env bash
# Runs the real-SGLang tests (pytest -m sglang_real) against an SGLang server on the CPU.
#
# SGLang has no CPU kernel wheel, but its server runs on the CPU with the torch-native attention backend once an
# import-only stub of `sgl_kernel` is on PYTHONPATH (tests/sglang_stub/, never put on the path of the default
# suite). The recipe (see DESIGN.md, "Facts measured on this machine"):
#   1. a separate venv (default ~/.cache/arl/venv-sglang, override with ARL_SGLANG_VENV) with torch==2.14.1 and
#      torchvision==0.29.1 (sglang imports torchvision at start-up; PyPI's torchvision does not import beside the
#      CPU torch 2.13.0 file, this pair installs from the machine's local wheel store and runs on the CPU),
#   2. sglang==0.5.23 installed with --no-deps, then its pure-Python runtime dependencies under a constraint that
#      keeps torch at 2.14.1 (CUDA-only kernel packages are left out),
#   3. the tests, with the stub and the repository on PYTHONPATH.
# The venv is reused when its recipe did not change (a stamp file holds the recipe's hash); ARL_SGLANG_BUILD_ONLY=1
# builds (or checks) it and stops there. Usage:
#   bash scripts/test_sglang_cpu.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VENV=${ARL_SGLANG_VENV:-$HOME/.cache/arl/venv-sglang}
SGLANG_VERSION=${ARL_SGLANG_VERSION:-0.5.23}

# Pure-Python (or CPU-wheel) runtime dependencies of sglang's HTTP server + scheduler on the generate path.
# soundfile stays at 0.13.1: its manylinux wheel carries libsndfile; 0.14.0 is a pure wheel that needs the system's
# libsndfile1, which a fresh machine lacks (CI failed on it: OSError at `import soundfile` in sglang's start-up).
DEPS=(
  "transformers==5.19.0" dill "soundfile==0.13.1" "tokenizers==0.23.2" safetensors numpy aiohttp fastapi "uvicorn>=0.51" uvloop orjson
  msgspec pydantic python-multipart pyzmq psutil requests setproctitle pybase64 partial_json_parser
  "prometheus-client>=0.20.0" packaging regex tqdm pillow einops interegular "xgrammar==0.2.7"
  "llguidance>=1.7.6,<2.0.0" "openai==2.8.0" "openai-harmony==0.0.4" "anthropic>=0.20.0" tiktoken
  "sentencepiece==0.2.1" xxhash zstandard watchfiles distro easydict "blobfile==3.0.0" scipy "msgpack"
  huggingface_hub "compressed-tensors==0.18.0" gguf "mistral_common>=1.11.5" "smg-grpc-servicer>=0.9.0"
  "apache-tvm-ffi==0.1.11" ninja nvidia-ml-py "python-dateutil<3" IPython omegaconf
  pytest pytest-asyncio pytest-timeout
)
TORCH=("torch==2.14.1" "torchvision==0.29.1")
RECIPE="${TORCH[*]} sglang==$SGLANG_VERSION ${DEPS[*]}"
STAMP="$VENV/.arl-recipe"
HASH=$(printf '%s' "$RECIPE" | sha256sum | cut -d' ' -f1)

t0=$(date +%s)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$HASH" ]; then
  echo "[sglang-cpu] building $VENV (sglang $SGLANG_VERSION, ${TORCH[*]})"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  CONS=$(mktemp)
  echo "${TORCH[0]}" > "$CONS"
  # uv when it can be had (scripts/uv_install.sh: pip's own settings, much faster on an empty cache), else pip
  . "$ROOT/scripts/uv_install.sh"
  if ! { uv_install "$VENV/bin/python" --compile-bytecode -c "$CONS" "${TORCH[@]}" \
         && uv_install "$VENV/bin/python" --compile-bytecode --no-deps "sglang==$SGLANG_VERSION" \
         && uv_install "$VENV/bin/python" --compile-bytecode -c "$CONS" "${DEPS[@]}"; }; then
    PIP=("$VENV/bin/pip" install -q --disable-pip-version-check -c "$CONS")
    "${PIP[@]}" "${TORCH[@]}"
    "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
    "${PIP[@]}" "${DEPS[@]}"
  fi
  rm -f "$CONS"
  echo "$HASH" > "$STAMP"
  echo "[sglang-cpu] venv ready in $(( $(date +%s) - t0 ))s ($(du -sh "$VENV" | cut -f1))"
else
  echo "[sglang-cpu] reusing $VENV"
fi
if [ "${ARL_SGLANG_BUILD_ONLY:-0}" = 1 ]; then  # .ci/run builds the venv beside the suite (downloads, not cores)
  exit 0
fi

t1=$(date +%s)
export PYTHONPATH="$ROOT/tests/sglang_stub:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export ARL_SGLANG_REAL=1 SGLANG_USE_CPU_ENGINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# the launcher test runs the training entry point with the project's own python (DeepSpeed is not in this venv):
# $ARL_MAIN_PYTHON, else the first of the repository's .venv, the active venv, python3 on PATH that imports it
if [ -z "${ARL_MAIN_PYTHON:-}" ]; then
  for cand in "$ROOT/.venv/bin/python" "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" "$(command -v python3 || true)"; do
    if [ -n "$cand" ] && [ -x "$cand" ] && PYTHONPATH="$ROOT" "$cand" -c "import deepspeed, arl" >/dev/null 2>&1; then
      ARL_MAIN_PYTHON=$cand
      break
    fi
  done
fi
if [ -z "${ARL_MAIN_PYTHON:-}" ]; then
  echo "[sglang-cpu] no python with DeepSpeed and arl found (tried $ROOT/.venv, \$VIRTUAL_ENV, python3);" \
       "set ARL_MAIN_PYTHON to the project's venv python (bash scripts/install.sh makes $ROOT/.venv)" >&2
  exit 2
fi
export ARL_MAIN_PYTHON
echo "[sglang-cpu] training entry point runs with $ARL_MAIN_PYTHON"
set +e
LOG=$(mktemp)
# -rs lists any skipped test with its reason; a skip is a failure here (the point of this run is that all ran)
"$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider -m sglang_real tests/inference/test_sglang_real.py "$@" \
  | tee "$LOG"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ] && grep -qE '[0-9]+ skipped' "$LOG"; then
  echo "[sglang-cpu] some tests were skipped (see the reasons above): counted as a failure" >&2
  rc=1
fi
rm -f "$LOG"
set -e
echo "[sglang-cpu] tests finished with exit code $rc in $(( $(date +%s) - t1 ))s (total $(( $(date +%s) - t0 ))s)"
exit $rc
