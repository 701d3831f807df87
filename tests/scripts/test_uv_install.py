"""scripts/uv_install.sh hands uv what pip is configured with: each pip configuration here is a fake file
(PIP_CONFIG_FILE, with the user's and the machine's PIP_* variables and user files out of the way) and the test reads
the uv arguments it would use (`uv_config_args`). The uv it bootstraps is pinned: a fake python records the pip
install it is asked for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "uv_install.sh"


def run(snippet: str, tmp_path: Path, config: str = "", **env: str) -> subprocess.CompletedProcess:
    """`snippet` under bash with uv_install.sh sourced; pip reads `config` as its configuration file."""
    (tmp_path / "pip.conf").write_text(config)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    clean.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "xdg"), XDG_CONFIG_DIRS=str(tmp_path / "xdg"),
                 PIP_CONFIG_FILE=str(tmp_path / "pip.conf"), PY=sys.executable, **env)
    return subprocess.run(["bash", "-c", f'. "{SCRIPT}"; {snippet}'], capture_output=True, text=True, env=clean,
                          timeout=120)


def uv_args(tmp_path: Path, config: str, **env: str) -> list[str]:
    p = run('uv_config_args "$PY"', tmp_path, config, **env)
    assert p.returncode == 0, p.stderr
    return p.stdout.split("\n")[:-1]


def pairs(args: list[str], option: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == option]


def test_one_index_gets_no_best_match_strategy_and_trusted_hosts_pass_through(tmp_path):
    args = uv_args(tmp_path, "[global]\nindex-url = http://mirror.local/simple\ntrusted-host =\n  mirror.local\n"
                             "  other.local:8080\n")
    assert pairs(args, "--index-url") == ["http://mirror.local/simple"]
    assert pairs(args, "--allow-insecure-host") == ["mirror.local", "other.local:8080"], args
    assert "--index-strategy" not in args and "--no-index" not in args, args
    assert "--index-strategy" not in uv_args(tmp_path, "")  # PyPI alone: uv's own first-index is pip's answer


def test_several_indexes_get_pips_best_match(tmp_path):
    args = uv_args(tmp_path, "[global]\nindex-url = https://a.local/simple\nextra-index-url =\n"
                             "    https://b.local/simple\n    https://c.local/simple\n")
    assert pairs(args, "--index-url") == ["https://a.local/simple"]
    assert pairs(args, "--extra-index-url") == ["https://b.local/simple", "https://c.local/simple"], args
    assert pairs(args, "--index-strategy") == ["unsafe-best-match"], args
    # an extra index beside PyPI is two indexes too
    assert pairs(uv_args(tmp_path, "[global]\nextra-index-url = https://b.local/simple\n"),
                 "--index-strategy") == ["unsafe-best-match"]


def test_no_index_passes_through_and_drops_the_indexes(tmp_path):
    args = uv_args(tmp_path, "[global]\nno-index = true\nfind-links = /wheels\nindex-url = https://a.local/simple\n"
                             "extra-index-url = https://b.local/simple\n")
    assert "--no-index" in args and pairs(args, "--find-links") == ["/wheels"], args
    assert "--index-url" not in args and "--extra-index-url" not in args and "--index-strategy" not in args, args
    assert "--no-index" in uv_args(tmp_path, "", PIP_NO_INDEX="yes")  # pip's variable, as pip reads it
    assert "--no-index" not in uv_args(tmp_path, "[global]\nno-index = false\n")


def fake_python(tmp_path: Path, uv_version: str = "") -> Path:
    """A venv's bin/ with a python that logs its argv and fails, and (with `uv_version`) a uv that reports it."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    py = bin_dir / "python"
    py.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/py.log"\nexit 1\n')
    py.chmod(0o755)
    if uv_version:
        uv = bin_dir / "uv"
        uv.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo "uv {uv_version} (fake)" && exit 0\nexit 3\n')
        uv.chmod(0o755)
    return py


def test_the_bootstrapped_uv_is_the_pinned_version(tmp_path):
    pinned = run('echo "$UV_VERSION"', tmp_path).stdout.strip()
    assert pinned.count(".") == 2, pinned
    py = fake_python(tmp_path)
    p = run(f'uv_install "{py}" pkg', tmp_path)
    assert p.returncode != 0  # the fake pip fails: the caller falls back to pip
    assert f"uv=={pinned}" in (tmp_path / "py.log").read_text().split(), (tmp_path / "py.log").read_text()


def test_a_venvs_uv_of_another_version_is_replaced_by_the_pinned_one(tmp_path):
    pinned = run('echo "$UV_VERSION"', tmp_path).stdout.strip()
    py = fake_python(tmp_path, uv_version="0.0.1")
    run(f'uv_install "{py}" pkg', tmp_path)
    assert f"uv=={pinned}" in (tmp_path / "py.log").read_text().split()
