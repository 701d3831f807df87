"""Optional packages (the extras): imported only where a run chose what needs them, with one clear error."""

from __future__ import annotations

import importlib
from types import ModuleType


def import_optional(module: str, missing: str) -> ModuleType:
    """``import module``, or ImportError(``missing``) (it says which extra to install) chained to the original."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(missing) from e
