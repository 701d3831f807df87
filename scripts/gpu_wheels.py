"""The wheels a GPU machine needs to run the project: what setup.py's install_requires asks for that the machine's
image lacks, for its Python 3.12 on manylinux x86_64, put in `.whl/` (ignored by git), which travels with the
working tree and which `scripts/gpu_check.sh` installs from there (that machine has no network). Its own torch and
transformers are used as they are; the project itself travels as source (PYTHONPATH).

    python scripts/gpu_wheels.py            # download (and build the sdist-only ones) into .whl/, print the list
    python scripts/gpu_wheels.py --check    # then prove the list installs the project on a clean Python 3.12

The check is offline: pip's resolver (`pip install --dry-run --no-index`, target Python 3.12, manylinux x86_64,
wheels only) on the project's requirements, finding each package either in .whl/ or among stand-in wheels for the
image's own packages (`scripts/gpu_device_packages.txt`, made here, empty). Where a Python 3.12 is found
(ARL_PYTHON312, `python3.12`, or pyenv's), the same set is also installed for real into a fresh venv of it and the
compiled modules carried are imported.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEST = os.path.join(ROOT, ".whl")
DEVICE_LIST = os.path.join(ROOT, "scripts", "gpu_device_packages.txt")
# What the image lacks, pinned to the versions CI tests with (scripts/install.sh's venv). One version of each.
CARRY = [
    "pyzmq==27.3.0",
    "omegaconf==2.4.0",  # needs only PyYAML (2.3 pinned antlr4-python3-runtime 4.9, an sdist)
    "deepspeed==0.19.8",  # an sdist: built here as a pure-python wheel (DS_BUILD_OPS=0, no compiled op)
    "hjson==3.1.0", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",  # deepspeed's
    "typing-inspection==0.4.5", "typing-extensions==4.16.0",  # pydantic's (the image's typing-extensions: unknown)
    "math-verify==0.9.0", "latex2sympy2-extended==1.11.0", "antlr4-python3-runtime==4.13.2",
]
BUILD = {"deepspeed": {"DS_BUILD_OPS": "0"}}  # sdist only on PyPI: `pip wheel --no-deps` here, with this env
UNLISTED = "9999"  # the stand-in version of an image package whose version the notes do not give
IMPORT_CHECK = ["zmq", "pydantic_core", "hjson", "antlr4"]  # carried modules that import without the image's
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *[a for n in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
                          "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
              for a in ("--platform", n)]]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_key(filename: str) -> tuple[str, str]:
    """(normalised name, version) of a wheel file."""
    name, version = os.path.basename(filename).split("-")[:2]
    return norm(name), version


def duplicates(files: list[str]) -> list[str]:
    """Names present in more than one version (pip refuses to install two)."""
    seen: dict[str, set[str]] = {}
    for f in files:
        n, v = wheel_key(f)
        seen.setdefault(n, set()).add(v)
    return sorted(n for n, vs in seen.items() if len(vs) > 1)


def project_requirements(setup_py: str = os.path.join(ROOT, "setup.py")) -> list[str]:
    """setup.py's install_requires, read without running it."""
    tree = ast.parse(open(setup_py).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    raise ValueError(f"no install_requires in {setup_py}")


def device_packages(path: str = DEVICE_LIST) -> list[tuple[str, Optional[str]]]:
    out = []
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out.append((norm(name), version or None))
    return out


def stub_wheel(folder: str, name: str, version: str) -> str:
    """An empty wheel standing for a package the image has (what pip's resolver needs to know it is there)."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = os.path.join(folder, f"{dist}-py3-none-any.whl")
    files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: arl-gpu-wheels\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def clean_pip_env() -> dict[str, str]:
    """This machine's pip settings (its find-links, extra indexes, the torch cap) have no say in the check."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def pip(args: list[str], env: Optional[dict[str, str]] = None, python: str = sys.executable) -> None:
    print("+ pip " + " ".join(args), flush=True)
    subprocess.run([python, "-m", "pip", *args], check=True, env=env)


def download(dest: str = DEST) -> list[str]:
    os.makedirs(dest, exist_ok=True)
    binary = [r for r in CARRY if norm(r.split("==")[0]) not in BUILD]
    pip(["download", "-q", "--no-deps", *PLATFORM, "-d", dest, *binary])
    for req in CARRY:
        name = norm(req.split("==")[0])
        if name in BUILD:
            pip(["wheel", "-q", "--no-deps", "--no-binary", name, "-w", dest, req], env={**os.environ, **BUILD[name]})
    wanted = {(norm(n), v) for n, v in (r.split("==") for r in CARRY)}
    files = sorted(glob.glob(os.path.join(dest, "*.whl")))
    for f in files:
        if wheel_key(f) not in wanted:  # an older pin: one version of each
            os.unlink(f)
    files = sorted(glob.glob(os.path.join(dest, "*.whl")))
    missing = wanted - {wheel_key(f) for f in files}
    if missing:
        raise SystemExit(f"not downloaded: {sorted(missing)}")
    return files


def find_python312() -> Optional[str]:
    candidates = [os.environ.get("ARL_PYTHON312", ""), shutil.which("python3.12") or ""]
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        candidates += sorted(glob.glob(os.path.join(root, "versions", "3.12*", "bin", "python3.12")), reverse=True)
    for c in filter(None, candidates):
        r = subprocess.run([c, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"], capture_output=True,
                           text=True)
        if r.returncode == 0 and r.stdout.strip() == "True":
            return c
    return None


def check(dest: str = DEST) -> None:
    files = sorted(glob.glob(os.path.join(dest, "*.whl")))
    dup = duplicates(files)
    if dup:
        raise SystemExit(f"{dest} holds several versions of {dup}: the device's pip would refuse them")
    carried = {wheel_key(f)[0] for f in files}
    reqs = project_requirements()
    env = clean_pip_env()
    with tempfile.TemporaryDirectory(prefix="arl-gpu-wheels-") as tmp:
        stubs = os.path.join(tmp, "device")
        os.makedirs(stubs)
        for name, version in device_packages():
            if name not in carried:  # a carried wheel shadows the image's copy (PYTHONPATH first)
                stub_wheel(stubs, name, version or UNLISTED)
        report = os.path.join(tmp, "report.json")
        pip(["install", "--dry-run", "--ignore-installed", "--no-index", "--find-links", dest, "--find-links", stubs,
             *PLATFORM, "--target", os.path.join(tmp, "target"), "--report", report, "-q", *reqs], env=env)
        resolved = json.load(open(report))["install"]
        rows = sorted((norm(r["metadata"]["name"]), r["metadata"]["version"],
                       "carried" if norm(r["metadata"]["name"]) in carried else "device") for r in resolved)
        print(f"the project's requirements resolve for Python 3.12 / manylinux x86_64 to {len(rows)} distributions:")
        for n, v, where in rows:
            print(f"  {where:8s} {n}" + (" (version not listed: checked by name)" if v == UNLISTED else f"=={v}"))
        unused = carried - {n for n, _, where in rows if where == "carried"}
        if unused:
            print(f"  (carried but not needed: {sorted(unused)})")
        py = find_python312()
        if py is None:
            print("no Python 3.12 here (ARL_PYTHON312, python3.12, pyenv): the real venv install was skipped")
            return
        venv = os.path.join(tmp, "venv")
        subprocess.run([py, "-m", "venv", venv], check=True)
        vpy = os.path.join(venv, "bin", "python")
        pip(["install", "-q", "--no-index", "--find-links", dest, "--find-links", stubs, *reqs], env=env, python=vpy)
        code = f"import sys, {', '.join(IMPORT_CHECK)}; print('imported {', '.join(IMPORT_CHECK)} on', sys.version)"
        subprocess.run([vpy, "-c", code], check=True)
    print("gpu wheels: OK")


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="after downloading, prove the list installs the project")
    ap.add_argument("--no-download", action="store_true", help="check what .whl/ holds, fetch nothing")
    ap.add_argument("--dest", default=DEST)
    a = ap.parse_args(argv)
    files = sorted(glob.glob(os.path.join(a.dest, "*.whl"))) if a.no_download else download(a.dest)
    total = sum(os.path.getsize(f) for f in files)
    print(f"{len(files)} wheels in {a.dest} ({total / 2**20:.1f} MiB; the device tool carries 64 MiB with the tree):")
    for f in files:
        print(f"  {os.path.basename(f)}")
    if a.check or a.no_download:
        check(a.dest)


if __name__ == "__main__":
    main()
