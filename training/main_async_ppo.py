"""Train with asynchronous PPO: `python training/main_async_ppo.py [experiment=NAME] key=value ...`.

With no arguments it runs the built-in default: a tiny char-level Llama, warmed up on a+b, trained by the
multi-turn math agent on CPU. `--help` lists every field.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl.cli import main  # noqa: E402
from experiments import MODULES  # noqa: E402 - the built-in experiments (the library does not import them)

if __name__ == "__main__":
    sys.exit(main(experiments=MODULES))
