# Sourced by install.sh and test_sglang_cpu.sh: `uv_install PYTHON [uv pip install args...]` installs into the venv
# of PYTHON with uv (version UV_VERSION, bootstrapped into that venv with its pip, ~4 s), given pip's own
# configuration (index URLs, no-index, find-links, trusted hosts, constraint files, CA file) so that it sees the same
# packages pip would, and pip's choice among several indexes (the best version over all of them; with one index uv
# keeps its own first-index rule, which is then the same). Returns non-zero when uv cannot be had or the install
# fails, so the caller can fall back to pip. ARL_INSTALLER=pip makes it return 1 at once.

# Pinned, so that a new uv release cannot change what the first command does (ARL_UV_VERSION overrides).
UV_VERSION=${ARL_UV_VERSION:-0.13.9}

# `pip_setting PYTHON OPTION [LISTING]`: the values pip is configured with for one option, one per line, as pip
# would use them: a PIP_* variable over the `install` section over `global`, a list option split on whitespace.
# LISTING is `pip config list`'s output (Python reprs), read once by the caller; without it pip is asked.
pip_setting() {
    { if [ $# -ge 3 ]; then printf '%s\n' "$3"; else "$1" -m pip config list 2>/dev/null; fi; } | "$1" -c '
import ast, sys
found = {}
for line in sys.stdin:
    key, _, value = line.rstrip("\n").partition("=")
    section, _, name = key.rpartition(".")
    if name == sys.argv[1] and value:
        found[section] = ast.literal_eval(value)
for section in (":env:", "install", "global"):
    if section in found:
        print(*found[section].split(), sep="\n")
        break' "$2"
}

# uv's arguments for pip's configuration, one per line (what uv_install passes; the tests read them).
uv_config_args() {
    local py=$1 url indexes=1 listing
    listing=$("$py" -m pip config list 2>/dev/null) || true
    case "$(pip_setting "$py" no-index "$listing" | head -1 | tr '[:upper:]' '[:lower:]')" in
        1|true|yes|on) echo --no-index ;;
        *)
            for url in $(pip_setting "$py" index-url "$listing" | head -1); do printf '%s\n' --index-url "$url"; done
            for url in $(pip_setting "$py" extra-index-url "$listing"); do
                printf '%s\n' --extra-index-url "$url"; indexes=$((indexes + 1))
            done
            [ "$indexes" -eq 1 ] || printf '%s\n' --index-strategy unsafe-best-match ;;
    esac
    for url in $(pip_setting "$py" find-links "$listing"); do printf '%s\n' --find-links "$url"; done
    for url in $(pip_setting "$py" trusted-host "$listing"); do printf '%s\n' --allow-insecure-host "$url"; done
    for url in $(pip_setting "$py" constraint "$listing"); do printf '%s\n' -c "$url"; done
}

uv_install() {
    local py=$1; shift
    [ "${ARL_INSTALLER:-uv}" != pip ] || return 1
    local uv; uv="$(dirname "$py")/uv"
    if ! [ -x "$uv" ] || [ "$("$uv" --version 2>/dev/null | cut -d' ' -f2)" != "$UV_VERSION" ]; then
        "$py" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION" || return 1
    fi
    local args cert
    mapfile -t args < <(uv_config_args "$py")
    cert=$(pip_setting "$py" cert | head -1)
    [ -z "$cert" ] || [ -n "${SSL_CERT_FILE:-}" ] || export SSL_CERT_FILE="$cert"
    "$uv" pip install -q --python "$py" "${args[@]}" "$@"
}
