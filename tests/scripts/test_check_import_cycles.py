"""scripts/check_import_cycles.py finds import cycles between modules and between packages, lazy imports included,
on a throwaway package; and arl has none."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from scripts.check_import_cycles import cycles, main, report


def _package(root: Path, files: dict[str, str]) -> None:
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


def test_reports_module_and_package_cycles_with_lazy_imports(tmp_path: Path, monkeypatch, capsys) -> None:
    _package(tmp_path, {
        "cyc/__init__.py": "",
        "cyc/low/__init__.py": "",
        "cyc/low/a.py": "from cyc.low import b\n",
        "cyc/low/b.py": "def f():\n    import cyc.low.a  # a lazy import closes the circle\n",
        "cyc/low/util.py": "X = 1\n",
        "cyc/high/__init__.py": "",
        "cyc/high/c.py": "from cyc.low.util import X\n",
        "cyc/low/d.py": "def g():\n    from cyc.high.c import X\n",  # low -> high -> low: packages only
        "cyc/fine.py": "import cyc.low.util\n",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    lines = report("cyc")
    assert lines == ["package cycle (2): cyc.high -> cyc.low -> cyc.high",
                     "module cycle (2): cyc.low.a -> cyc.low.b -> cyc.low.a"]
    assert main(["cyc"]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines() == lines and "2 cycle(s) in cyc" in out.err


def test_a_package_without_cycles_passes(tmp_path: Path, monkeypatch, capsys) -> None:
    _package(tmp_path, {
        "acyc/__init__.py": "from acyc import a\n",
        "acyc/a.py": "def f():\n    from acyc.sub import b\n",
        "acyc/sub/__init__.py": "",
        "acyc/sub/b.py": "import os\n",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    assert report("acyc") == []
    assert main(["acyc"]) == 0 and "none in acyc" in capsys.readouterr().out


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"a"}, "b": set()}, [["a"]]),  # a module importing itself
    ({"a": {"b"}, "b": set()}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}}, [["a", "b"], ["c", "d"]]),
])
def test_cycles_are_the_strongly_connected_components(graph: dict, expected: list) -> None:
    assert cycles(graph) == expected


def test_arl_has_no_import_cycle() -> None:
    assert report("arl") == []
