"""Each tracker holds the run's scalars at their steps, read back with the library's own reader."""

from __future__ import annotations

import glob
import json
import os
import struct

import pytest

from arl.api.registry import RegistryError
from arl.controller.reporting import JsonlSink, Reporter
from arl.report.trackers import TrackerSink, flatten_params, flatten_scalars, make_sinks

CONFIG = {"experiment": "unit", "learner": {"lr": 1e-4, "batch_size": 4}, "loggers": ["jsonl", "tensorboard"]}
RECORDS = [
    {"type": "eval", "step": 0, "first_acc": 0.25, "solved_acc": 0.5, "errors": {}, "token_versions": [0, 0]},
    {"type": "train", "step": 1, "reward_mean": 0.125, "head_offpolicyness": 1.0, "groups": {"accepted": 3},
     "rollout": {"turns": 2.5}},
    {"type": "fault", "kind": "rollout_exit", "role": "rollout0"},  # no step, no numbers: jsonl only
    {"type": "train", "step": 2, "reward_mean": 0.375, "head_offpolicyness": 2.0, "groups": {"accepted": 7},
     "rollout": {"turns": 1.5}},
    {"type": "eval", "step": 2, "first_acc": 0.75, "solved_acc": 0.875, "ok": True},
]
EXPECTED = {  # key -> [(step, value)]
    "eval/first_acc": [(0, 0.25), (2, 0.75)],
    "eval/solved_acc": [(0, 0.5), (2, 0.875)],
    "train/reward_mean": [(1, 0.125), (2, 0.375)],
    "train/head_offpolicyness": [(1, 1.0), (2, 2.0)],
    "train/groups/accepted": [(1, 3.0), (2, 7.0)],
    "train/rollout/turns": [(1, 2.5), (2, 1.5)],
}


def _log_run(tmp_path, names: list[str]) -> str:
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    sinks = [JsonlSink(os.path.join(run_dir, "metrics.jsonl")), *make_sinks(names, run_dir, CONFIG, "unit-exp")]
    reporter = Reporter(sinks, total_steps=2)
    for r in RECORDS:
        reporter.write(dict(r), r.get("step"))
    reporter.close()
    return run_dir


def test_flatten_scalars_nests_with_slashes_and_drops_non_numbers() -> None:
    flat = flatten_scalars({"type": "train", "step": 3, "time": 1.0, "a": 1, "ok": False, "s": "x", "l": [1],
                            "n": None, "d": {"e": {"f": 2.5}}})
    assert flat == {"train/a": 1.0, "train/ok": 0.0, "train/d/e/f": 2.5}
    assert flatten_params({"a": {"b": 1, "c": [1, 2]}, "d": "x"}) == {"a.b": 1, "a.c": "[1, 2]", "d": "x"}


def test_unknown_logger_is_an_error() -> None:
    assert make_sinks(["jsonl"], "unused", {}, "x") == []  # metrics.jsonl is the controller's own sink
    with pytest.raises(RegistryError, match="unknown logger 'neptune'"):
        make_sinks(["neptune"], "unused", {}, "x")


def test_jsonl_always_holds_every_record(tmp_path) -> None:
    run_dir = _log_run(tmp_path, [])
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["type"] for r in lines] == [r["type"] for r in RECORDS]
    assert lines[2]["role"] == "rollout0" and all("time" in r for r in lines)


def test_tensorboard_event_files_hold_the_scalars(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _log_run(tmp_path, ["jsonl", "tensorboard"])
    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    acc.Reload()
    for key, points in EXPECTED.items():
        got = [(e.step, pytest.approx(e.value)) for e in acc.Scalars(key)]
        assert got == points, key
    assert "config" in " ".join(acc.Tags()["tensors"])  # the config as a text summary
    plugins = acc.PluginTagToContent("hparams")
    assert plugins, "the config is logged as hparams"


def _read_wandb_records(path: str) -> list:
    """The records of a .wandb transaction log: its framing (a 7-byte ':W&B' header, then 32 KiB blocks of
    crc/length/type-framed chunks) read here, each record parsed with wandb's own protobuf schema. (wandb >= 0.2x
    no longer ships a Python reader for the file; wandb.Api reads only synced runs.)"""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), "not a .wandb transaction log"
    block, pos, buf, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and n == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # FULL, LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_wandb_offline_run_holds_the_scalars(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = _log_run(tmp_path, ["wandb"])
    files = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb"))
    assert len(files) == 1, files
    records = _read_wandb_records(files[0])
    got: dict[str, list] = {}
    config: dict[str, str] = {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            for k, v in row.items():
                if k in EXPECTED:
                    got.setdefault(k, []).append((int(row["step"]), pytest.approx(v)))
        elif kind == "run":
            config.update({u.key: u.value_json for u in rec.run.config.update})
        elif kind == "config":
            config.update({u.key: u.value_json for u in rec.config.update})
    assert got == EXPECTED
    assert json.loads(config["learner"]) == {"lr": 1e-4, "batch_size": 4}


def test_mlflow_file_store_run_holds_the_scalars(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    from mlflow.tracking import MlflowClient

    run_dir = _log_run(tmp_path, ["mlflow"])
    client = MlflowClient(tracking_uri="file:" + os.path.join(run_dir, "mlruns"))
    exp = client.get_experiment_by_name("unit-exp")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run = runs[0]
    assert run.data.params["learner.lr"] == "0.0001" and run.data.params["loggers"] == '["jsonl", "tensorboard"]'
    for key, points in EXPECTED.items():
        hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert [(s, pytest.approx(v)) for s, v in hist] == points, key


def test_a_failing_tracker_is_dropped_not_fatal(tmp_path) -> None:
    class Broken:
        closed = False

        def log(self, record, step):
            raise OSError("disk full")

        def close(self):
            Broken.closed = True

    broken = TrackerSink("broken", Broken())
    reporter = Reporter([JsonlSink(str(tmp_path / "metrics.jsonl")), broken], total_steps=2)
    reporter.write({"type": "train", "step": 1, "a": 1.0})
    reporter.write({"type": "train", "step": 2, "a": 2.0})
    assert broken._failed
    reporter.close()
    assert Broken.closed and len(open(tmp_path / "metrics.jsonl").readlines()) == 2
