"""The tracker this project was generated with (--tracker), for real and offline: rank 0 logs the
config once and every metric, and a resumed run continues the same tracker run."""

from __future__ import annotations

import importlib.util
import json
import struct
import zlib
from pathlib import Path

import pytest
from conftest import ok, one_error, read_metrics, torchrun

from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints, read_meta
from {{ cookiecutter.package_name }}.config import DEFAULT_TRACKER, TRACKERS

pytestmark = pytest.mark.full  # the slow tier: pytest --full

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}
ARGS = ["--hidden-size", "8", "--dataset-size", "256", "--batch-size", "16", "--log-every", "2",
        "--epochs", "2", "--save-every-steps", "4"]  # 8 steps an epoch


def read_tensorboard(output_dir: Path) -> tuple[dict[int, float], dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    steps, config = {}, {}
    for events in sorted((output_dir / "tensorboard").glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        steps.update({e.step: e.value for e in accumulator.Scalars("train/loss")})
        for event in accumulator.Tensors("config/text_summary"):
            text = event.tensor_proto.string_val[0].decode()
            config.update(json.loads(text.strip("`\n")))
    return steps, config


def wandb_records(path: Path):
    """The records of an offline W&B run file: a log of 32 KiB blocks holding protobuf records,
    each record whole (type 1) or in pieces (first 2, middle 3, last 4), each with a crc32."""
    from wandb.proto import wandb_internal_pb2
    data, position, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # the tail of a block is padding
            position += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 and length == 0:
            position += left
            continue
        payload = data[position + 7:position + 7 + length]
        if len(payload) < length:
            break
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc
        position += 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def item_key(item) -> str:
    """wandb >= 0.31 writes nested_key ["loss"] where older versions wrote key "loss"."""
    return item.key or ".".join(item.nested_key)


def read_wandb(output_dir: Path, run_id: str) -> tuple[dict[int, float], dict]:
    steps, config = {}, {}
    for path in (output_dir / "wandb").glob(f"offline-run-*/run-{run_id}.wandb"):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                config.update({item_key(i): json.loads(i.value_json)
                               for i in record.run.config.update})
            if kind == "history":
                row = {item_key(i): json.loads(i.value_json) for i in record.history.item}
                if "loss" in row:
                    steps[row["_step"]] = row["loss"]
    return steps, config


def read_mlflow(output_dir: Path, run_id: str) -> tuple[dict[int, float], dict]:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{(output_dir / 'mlflow.db').resolve()}")
    history = client.get_metric_history(run_id, "loss")
    return {m.step: m.value for m in history}, client.get_run(run_id).data.params


@pytest.mark.skipif(DEFAULT_TRACKER == "none", reason="this project has no tracker")
def test_the_tracker_logs_every_metric_and_a_resumed_run_continues_its_run(workdir):
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    ok(torchrun([*ARGS, "--max-steps", "6"], workdir, **env))
    first_id = read_meta(list_checkpoints(workdir / "checkpoints")[0])["tracker_run_id"]
    ok(torchrun(ARGS, workdir, **env))  # resumes at step 6
    run_id = read_meta(list_checkpoints(workdir / "checkpoints")[0])["tracker_run_id"]
    assert run_id == first_id
    expected = {m["step"]: m["loss"] for m in read_metrics(workdir / "runs/latest")}
    output = workdir / "runs/latest"
    if DEFAULT_TRACKER == "tensorboard":
        logged, config = read_tensorboard(output)
        assert config["batch_size"] == 16  # the run's config
    elif DEFAULT_TRACKER == "wandb":
        logged, config = read_wandb(output, run_id)
        assert config["batch_size"] == 16  # the run's config, logged once
    else:
        logged, config = read_mlflow(output, run_id)
        assert config["batch_size"] == "16"
    assert set(expected) <= set(logged), "every logged step is in the tracker's one run"
    for step, loss in expected.items():
        assert logged[step] == pytest.approx(loss, rel=1e-6)


MISSING = [t for t in TRACKERS[1:] if importlib.util.find_spec(t.split("-")[0]) is None]


@pytest.mark.parametrize("tracker", MISSING or ["none-missing"])
def test_a_tracker_whose_package_is_missing_is_one_error_line(workdir, tracker):
    if tracker == "none-missing":
        pytest.skip("every tracker package is installed here")
    line = one_error(torchrun([*ARGS, "--tracker", tracker], workdir))
    assert f"--tracker {tracker} needs the {PACKAGES[tracker]} package: pip install " \
        f"{PACKAGES[tracker]}" in line
    assert not list((workdir / "checkpoints").glob("ckpt_*")), "failed before any training"
