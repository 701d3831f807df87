"""Writes the bytecode of the modules the main job imports, and only those.

`scripts/install.sh` installs the base package without byte-compiling all of site-packages (torch alone is ~10k
files, most never imported by a run: about 60 s of CPU at install on this machine). Where PYTHONDONTWRITEBYTECODE
is set, nothing compiled at import time is kept, so every process of every run would compile its imports again;
this script imports what the roles import (every arl module, plus what DeepSpeed and transformers load lazily at
start-up) with bytecode writing on, so those .pyc files exist once, as a full compile would leave them.
"""

from __future__ import annotations

import compileall
import importlib
import os
import pkgutil
import sys
import warnings

# Imported lazily by deepspeed.initialize and the model/tokenizer builders, not by importing arl's modules.
LAZY_IMPORTS = (
    "deepspeed.runtime.engine",
    "deepspeed.ops.adam",
    "transformers.models.llama.modeling_llama",
    "transformers.models.auto.modeling_auto",
    "transformers.tokenization_utils_fast",
    "torch.optim.adamw",
)
# Subpackages the first default run still compiled after the imports above (found by listing the .pyc files a
# run wrote): compiled as files, since importing some of them needs packages the CPU install lacks (triton).
LAZY_DIRS = (
    ("deepspeed", "module_inject"),
    ("deepspeed", "moe"),
    ("deepspeed", "ops/triton_ops"),
    ("deepspeed", "comm"),
    ("torch", "utils/serialization"),
    ("torch", "profiler"),
    ("numpy", "ctypeslib"),
)


def main() -> int:
    sys.dont_write_bytecode = False
    warnings.filterwarnings("ignore")
    import arl

    names = [m.name for m in pkgutil.walk_packages(arl.__path__, "arl.")] + list(LAZY_IMPORTS)
    imported = 0
    for name in names:
        try:
            importlib.import_module(name)
            imported += 1
        except Exception:  # a module of an optional extra that is not installed
            pass
    for package, sub in LAZY_DIRS:
        root = os.path.dirname(importlib.import_module(package).__file__)
        path = os.path.join(root, sub)
        if os.path.isdir(path):
            compileall.compile_dir(path, quiet=2)
    print(f"[install] bytecode written for {imported} of {len(names)} start-up imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
