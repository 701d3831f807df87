import os

import pytest

from .harness import stop_runs_left_running


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    """The tiny model's warm-up cache: $ARL_TEST_MODEL_CACHE if set (reuse one across sessions), else one warm-up
    per test session shared by every fault run."""
    return os.environ.get("ARL_TEST_MODEL_CACHE") or str(tmp_path_factory.mktemp("arl-cache"))


@pytest.fixture(autouse=True)
def _no_run_left_running():
    """Whatever a test asserts, the run it started is gone when it ends."""
    yield
    stop_runs_left_running()
