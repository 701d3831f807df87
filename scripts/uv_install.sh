# Sourced by install.sh and test_sglang_cpu.sh: `uv_install PYTHON [uv pip install args...]` installs into the venv
# of PYTHON with uv (bootstrapped into that venv with its pip, ~4 s), given pip's own configuration (index URLs,
# find-links, constraint files, CA file) so that it sees the same packages pip would, and pip's choice among
# indexes (the best version over all of them). Returns non-zero when uv cannot be had or the install fails, so the
# caller can fall back to pip. ARL_INSTALLER=pip makes it return 1 at once.

# The values pip is configured with for one option (config files and PIP_* variables), one per word.
pip_setting() { "$1" -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.$2='\(.*\)'\$/\1/p"; }

uv_install() {
    local py=$1; shift
    [ "${ARL_INSTALLER:-uv}" != pip ] || return 1
    local uv; uv="$(dirname "$py")/uv"
    [ -x "$uv" ] || "$py" -m pip install -q --disable-pip-version-check uv || return 1
    local args=(--index-strategy unsafe-best-match) url cert
    for url in $(pip_setting "$py" index-url | head -1); do args+=(--index-url "$url"); done
    for url in $(pip_setting "$py" extra-index-url); do args+=(--extra-index-url "$url"); done
    for url in $(pip_setting "$py" find-links); do args+=(--find-links "$url"); done
    for url in $(pip_setting "$py" constraint); do args+=(-c "$url"); done
    cert=$(pip_setting "$py" cert | head -1)
    [ -z "$cert" ] || [ -n "${SSL_CERT_FILE:-}" ] || export SSL_CERT_FILE="$cert"
    "$uv" pip install -q --python "$py" "${args[@]}" "$@"
}
