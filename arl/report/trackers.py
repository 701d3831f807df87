"""Experiment trackers: the controller's metrics records sent, when chosen, to TensorBoard, Weights & Biases and
MLflow (as metric sinks of `arl.controller.reporting.Reporter`, beside metrics.jsonl).

`metrics.jsonl` stays the run's record of truth (every record, nested, always written). The other trackers get the
record's numbers flattened with "/" under its type (`train/reward_mean`, `train/rollout/turns`, `eval/first_acc`),
with the policy version (`step`) as the x axis, and the run's config once as params/hparams. Each library is
imported only when its tracker is chosen, so a run without them needs none installed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import time
from typing import Any, Callable, Optional, Protocol, Sequence

from arl.api.registry import TRACKERS

logger = logging.getLogger("arl.report")

_SKIP_KEYS = frozenset({"time", "type", "step"})


class Tracker(Protocol):
    """A sink for flat scalars: `log({"train/reward_mean": 0.3, ...}, step)`; `close()` flushes and ends it."""

    def log(self, record: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def flatten_scalars(record: dict) -> dict[str, float]:
    """The numbers of a metrics record, nested keys joined with "/" under the record's type (bools as 0/1; strings,
    lists and None left out: trackers plot numbers). `time`, `type` and `step` are the record's frame, not data."""
    out: dict[str, float] = {}
    _flatten(out, {k: v for k, v in record.items() if k not in _SKIP_KEYS}, str(record.get("type") or "metrics"))
    return out


def _flatten(out: dict[str, float], d: dict, prefix: str) -> None:
    for k, v in d.items():
        key = f"{prefix}/{k}"
        if isinstance(v, dict):
            _flatten(out, v, key)
        elif isinstance(v, (bool, int, float)):
            out[key] = float(v)


def flatten_params(config: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as flat params ("learner.lr": 1e-4); lists and other values as JSON text."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten_params(v, key))
        elif isinstance(v, (bool, int, float, str)) or v is None:
            out[key] = v
        else:
            out[key] = json.dumps(v, default=str)
    return out


class TensorBoardTracker:
    """Event files under `log_dir` (default run_dir/tensorboard); the config as hparams and as a text summary."""

    def __init__(self, log_dir: str, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self._w = SummaryWriter(log_dir=log_dir)
        params = {k: (v if isinstance(v, (bool, int, float, str)) else str(v))
                  for k, v in flatten_params(config).items()}
        if params:
            for summary in hparams(params, {}):  # experiment, session start, session end: same event file
                self._w.file_writer.add_summary(summary)
        self._w.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, record: dict[str, float], step: int) -> None:
        for k, v in record.items():
            self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbTracker:
    """A W&B run. WANDB_MODE decides online/offline (offline when unset, so a run never uploads by surprise:
    `wandb sync RUN_DIR/wandb/offline-run-*` uploads it later); its files live in `dir` (default the run
    directory). `step` is a defined metric used as the x axis of every other one, so an evaluation that arrives
    after a later train step still lands at its own version."""

    def __init__(self, dir: str, config: dict, name: str, project: Optional[str] = None) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or "offline"
        os.makedirs(dir, exist_ok=True)
        self._run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "arl", name=name, dir=dir,
                               config=config, mode=mode, reinit="create_new")
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log(self, record: dict[str, float], step: int) -> None:
        self._run.log({**record, "step": step})

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() can return before wandb's service has written the run's transaction log (seen with 0.31 under
        # load: the .wandb file held its header only for a moment); teardown waits for the service to finish
        wandb.teardown()


_MLFLOW_BAD = re.compile(r"[^\w\-. /:]")


class MlflowTracker:
    """An MLflow run: MLFLOW_TRACKING_URI when set, else a file store in run_dir/mlruns (`mlflow ui
    --backend-store-uri RUN_DIR/mlruns` shows it); the experiment is named after the run's experiment, the run
    after the run directory."""

    _MAX_METRICS, _MAX_PARAMS, _MAX_PARAM_LEN = 1000, 100, 6000  # MLflow's log_batch and param value limits

    def __init__(self, tracking_uri: str, config: dict, experiment_name: str, run_name: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking_uri)
        exp = self._client.get_experiment_by_name(experiment_name)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(experiment_name)
        self.run_id = self._client.create_run(exp_id, run_name=run_name).info.run_id
        params = [Param(self._key(k), str(v)[: self._MAX_PARAM_LEN]) for k, v in flatten_params(config).items()]
        for i in range(0, len(params), self._MAX_PARAMS):
            self._client.log_batch(self.run_id, params=params[i: i + self._MAX_PARAMS])

    @staticmethod
    def _key(k: str) -> str:
        return _MLFLOW_BAD.sub("_", k)

    def log(self, record: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(self._key(k), v, ts, step) for k, v in record.items() if math.isfinite(v)]
        for i in range(0, len(metrics), self._MAX_METRICS):
            self._client.log_batch(self.run_id, metrics=metrics[i: i + self._MAX_METRICS])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _tensorboard(run_dir: str, config: dict, experiment_name: str) -> Tracker:
    return TensorBoardTracker(os.path.join(run_dir, "tensorboard"), config)


def _wandb(run_dir: str, config: dict, experiment_name: str) -> Tracker:
    return WandbTracker(run_dir, config, name=f"{experiment_name}/{os.path.basename(os.path.normpath(run_dir))}")


def _mlflow(run_dir: str, config: dict, experiment_name: str) -> Tracker:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        # MLflow 3 keeps the file store in maintenance mode behind this opt-in; it is the one local backend that
        # needs no database packages (mlflow-skinny has none), so the default run directory store opts in
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = "file:" + os.path.join(os.path.abspath(run_dir), "mlruns")
    return MlflowTracker(uri, config, experiment_name or "arl", os.path.basename(os.path.normpath(run_dir)))


@dataclasses.dataclass(frozen=True)
class TrackerEntry:
    make: Callable[[str, dict, str], Tracker]  # (run_dir, config, experiment_name) -> tracker
    package: str  # what to pip install when its library is missing


# the built-ins, bound by name in `arl.api.registry.TRACKERS` (config validation reads the names there)
TENSORBOARD = TrackerEntry(_tensorboard, "tensorboard")
WANDB = TrackerEntry(_wandb, "wandb")
MLFLOW = TrackerEntry(_mlflow, "mlflow-skinny")


class TrackerSink:
    """A tracker as one of the controller's metric sinks (`arl.controller.reporting.MetricsSink`): each record's
    numbers go to it flattened; a tracker that fails while logging is reported once and left out for the rest of
    the run: a dashboard must not stop a run."""

    def __init__(self, name: str, tracker: Tracker) -> None:
        self.name, self.tracker = name, tracker
        self._failed = False

    def log(self, record: dict, step: int) -> None:
        scalars = flatten_scalars(record)
        if self._failed or not scalars:
            return
        try:
            self.tracker.log(scalars, step)
        except Exception as e:  # noqa: BLE001
            self._failed = True
            logger.warning("logger %s failed (%s: %s); it is left out for the rest of the run", self.name,
                           type(e).__name__, e)

    def close(self) -> None:
        try:
            self.tracker.close()
        except Exception as e:  # noqa: BLE001
            logger.warning("logger %s did not close cleanly: %s: %s", self.name, type(e).__name__, e)


def make_sinks(names: Sequence[str], run_dir: str, config: dict, experiment_name: str) -> list[TrackerSink]:
    """The trackers in `names` ("tensorboard", "wandb", "mlflow"; "jsonl" is always on and skipped here). A chosen
    tracker whose library is missing is an error at start, not a silently empty dashboard."""
    sinks: list[TrackerSink] = []
    try:
        for name in dict.fromkeys(str(n).strip().lower() for n in names):
            if name == "jsonl":
                continue
            entry = TRACKERS.get(name)
            try:
                sinks.append(TrackerSink(name, entry.make(run_dir, config, experiment_name)))
            except ImportError as e:
                raise RuntimeError(f"logger {name!r} needs the {entry.package} package (pip install "
                                   f"{entry.package}, or pip install 'arl[trackers]'): {e}") from None
            logger.info("logging metrics to %s", name)
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


__all__ = ["Tracker", "TrackerSink", "TrackerEntry", "TensorBoardTracker", "WandbTracker", "MlflowTracker",
           "TRACKERS", "flatten_scalars", "flatten_params", "make_sinks"]
