#!/usr/bin/env bash
# Render RUN_DIR/report.html in headless Chromium: no script error, not blank (see check_report_chromium.py).
# Usage: bash scripts/check_report_chromium.sh RUN_DIR [--screenshot PATH]. Needs chromium (Debian package).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PY=${PYTHON:-python3}
[ -x "$here/../.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && PY="$here/../.venv/bin/python"
exec "$PY" "$here/check_report_chromium.py" "$@"
