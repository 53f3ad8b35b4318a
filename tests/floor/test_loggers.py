"""run.loggers: wandb (offline) and mlflow (a local file store) get the same metrics, evaluations,
samples and the resolved config as the jsonl files, and a resumed run continues their runs."""

import struct
import sys

import pytest

from rlsys.config import ConfigError, load_config
from rlsys.tracking import Tracker, read_jsonl


def _cfg(tmp_path, loggers="[jsonl, tensorboard, wandb, mlflow]"):
    return load_config(None, [f"run.output_dir={tmp_path}", "run.name=logged", f"run.loggers={loggers}"])


def _wandb_records(run_dir):
    """The protobuf records of the offline wandb runs in `run_dir`, in order (each process's
    .wandb file is a LevelDB log: 32 KiB blocks of records with a 7-byte header: crc, length,
    kind full/first/middle/last)."""
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        yield from _leveldb_records(path)


def _leveldb_records(path):
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_history(run_dir) -> list[dict]:
    rows = []
    for r in _wandb_records(run_dir):
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): item.value_json for item in r.history.item})
    return rows


def _log_two_steps(tracker, first_step):
    samples = [{"prompt": "<|im_start|>user\n2+2<|im_end|>", "response": "4", "reward": 1.0, "reward/format": 0.5}]
    for step in (first_step, first_step + 1):
        tracker.log(step, {"reward/mean": step / 10, "loss": 1.0, "loss/policy": float("nan"), "loss/kl": 0.5})
        tracker.log_samples(step, samples)
    tracker.log_eval(first_step + 1, "heldout", {"accuracy": 0.75, "n": 4.0}, policy_version=first_step + 1)


def test_wandb_and_mlflow_get_the_metrics_samples_and_config_and_a_resume_continues_their_runs(tmp_path):
    from mlflow import MlflowClient

    cfg = _cfg(tmp_path)
    run_dir = tmp_path / "logged"
    tracker = Tracker(run_dir, cfg)
    _log_two_steps(tracker, 1)
    tracker.close()
    Tracker(run_dir, cfg).close(failed=True)  # a resumed run that fails at once
    tracker = Tracker(run_dir, cfg)  # and one that goes on
    _log_two_steps(tracker, 3)
    tracker.close()
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]

    # wandb: one offline run (the id kept in the run dir), every row with its step, the config
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 3  # one directory per process, one run id
    wandb_id = (run_dir / "wandb_id").read_text()
    assert all(f"-{wandb_id}" in p.name for p in run_dir.glob("wandb/offline-run-*"))
    history = _wandb_history(run_dir)
    rewards = [(int(r["step"]), float(r["reward/mean"])) for r in history if "reward/mean" in r]
    assert rewards == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert not any("loss/policy" in r for r in history)  # a nan is left out, as in TensorBoard
    assert [int(r["step"]) for r in history if "eval/heldout/accuracy" in r] == [2, 4]
    tables = [r for r in history if "samples/_type" in r]
    assert len(tables) == 4 and all(r["samples/_type"] == '"table-file"' for r in tables)
    (table_file,) = {p.name: p for p in run_dir.glob("wandb/offline-run-*/files/media/table/samples_1_*")}.values()
    assert '"reward/format"' in table_file.read_text() and "<|im_start|>user" in table_file.read_text()
    configs = [r.run.config for r in _wandb_records(run_dir) if r.WhichOneof("record_type") == "run"]
    assert any(item.key == "run" and '"logged"' in item.value_json for c in configs for item in c.update)

    # mlflow: one run in experiment run.project in run.output_dir/mlruns, finished
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run((run_dir / "mlflow_run_id").read_text())
    assert run.info.run_name == "logged" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "rlsys"
    history = client.get_metric_history(run.info.run_id, "reward.mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval.heldout.accuracy")] == [2, 4]
    assert run.data.metrics["loss"] == 1.0 and run.data.metrics["loss.kl"] == 0.5  # both, in a file store
    assert run.data.params["run.name"] == "logged" and run.data.params["trainer.steps"] == str(cfg.trainer.steps)
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "samples")]
    assert artifacts == [f"samples/step_00000{s}.json" for s in (1, 2, 3, 4)]


def test_a_logger_that_is_not_installed_fails_in_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"run.loggers names wandb .*pip install 'rlsys\[wandb\]'"):
        Tracker(tmp_path / "logged", _cfg(tmp_path, "[jsonl, wandb]"))


def test_loggers_must_keep_jsonl(tmp_path):
    with pytest.raises(ConfigError, match="run.loggers.*must include jsonl"):
        _cfg(tmp_path, "[tensorboard]")
