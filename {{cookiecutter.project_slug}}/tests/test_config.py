"""The command line and config files: every documented flag, values checked before any work."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import PROJECT_ROOT, ok, python_train, summary

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.config import Config, parse_args
from {{ cookiecutter.package_name }}.doctor import absolute_paths
from {{ cookiecutter.package_name }}.settings import build_parser

SETTINGS = getattr(task, "Settings", None)  # None: a task.py that declares no settings of its own

DOCUMENTED_FLAGS = [
    "--epochs", "--batch-size", "--lr", "--seed", "--data", "--num-workers",
    "--backend", "--init-method", "--timeout-s", "--checkpoint-dir", "--save-every",
    "--save-every-steps", "--keep-last", "--resume", "--precision", "--grad-accum", "--clip-grad",
    "--max-steps", "--log-every", "--output-dir", "--nprocs", "--no-progress", "--compile",
    "--find-unused-parameters", "--local-rank", "--local_rank", "--stage-devices", "--async-save",
    "--config", "--model-layout", "--tracker", "--profile-steps", "--run-name", "--eval-only",
    "--eval-every-steps", "--keep-best", "--early-stop", "--bucket-cap-mb", "--static-graph",
    "--comm-hook", "--gradient-as-bucket-view", "--no-gradient-as-bucket-view",
    "--powersgd-rank", "--powersgd-warmup-steps", "--ema-decay",
    "--shard-group-size",
]


def test_help_documents_every_flag():
    """The project's flags, and each setting of task.py's Settings."""
    fields = dataclasses.fields(SETTINGS) if SETTINGS else ()
    own = [f"--{f.name.replace('_', '-')}" for f in fields]
    text = build_parser(Config, SETTINGS).format_help()
    assert [flag for flag in [*DOCUMENTED_FLAGS, *own] if flag not in text] == []


def test_help_gives_each_default_once_and_none_for_lists():
    parser = build_parser(Config, SETTINGS)
    formatter = parser.formatter_class(prog="train.py")
    for action in parser._actions:  # argparse keeps them only here
        assert (formatter._get_help_string(action) or "").count("(default:") <= 1, action.dest
    text = " ".join(parser.format_help().split())
    assert "(default: DDP's 25, with a first bucket of 1) --" in text  # its own words, once
    assert "(default: [])" not in text  # --stage-devices


def test_both_local_rank_spellings():
    assert parse_args(["--local-rank=1"], SETTINGS).local_rank == 1
    assert parse_args(["--local_rank", "2"], SETTINGS).local_rank == 2


@pytest.mark.parametrize("argv, says", [
    (["--epochs", "0"], "--epochs: must be at least 1"),
    (["--backend", "mpi"], "invalid choice: 'mpi'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--stage-devices", "cuda:0"], "expected two devices"),
    (["--lr", "inf"], "--lr: must be a finite number"),
    (["--lr", "nan"], "--lr: must be a finite number"),
    (["--weight-decay", "-1"], "--weight-decay: must be a finite number at least 0"),
    (["--clip-grad", "nan"], "--clip-grad: must be a finite number"),
    (["--timeout-s", "inf"], "--timeout-s: must be a finite number"),
    (["--seed", "-3"], "--seed: must be between 0 and"),
    (["--seed", "99999999999"], "--seed: must be between 0 and"),
    (["--val-fraction", "1.5"], "--val-fraction: must be at least 0 and below 1"),
    (["--profile-steps", "9:3"], "expected FIRST:LAST"),
    (["--data", "/no/such/file.csv"], "--data /no/such/file.csv: no such file or folder"),
    (["--resume", "/no/such.pt"], "--resume /no/such.pt: no such file or folder"),
    (["--comm-hook", "int8"], "invalid choice: 'int8'"),
    (["--bucket-cap-mb", "0"], "--bucket-cap-mb: must be a finite number greater than 0"),
    (["--powersgd-warmup-steps", "1"], "--powersgd-warmup-steps: must be at least 2"),
    (["--num-workers", "65"], "--num-workers: must be between 0 and 64, got 65"),
    (["--lr", "11"], "--lr: must be a finite number greater than 0 and at most 10, got 11"),
    (["--ema-decay", "1"], "--ema-decay: must be 0 (off) or between 0 and 1, e.g. 0.999; got 1"),
    (["--epochs", "1.5"], "--epochs: invalid integer value: '1.5'"),
    (["--lr", "fast"], "--lr: invalid number value: 'fast'"),
    (["--static-graph", "--grad-accum", "2"], "--static-graph does not work with --grad-accum"),
])
def test_bad_values_exit_2_with_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, SETTINGS)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines


def test_ddp_options_are_config_file_keys_too(tmp_path):
    path = tmp_path / "ddp.toml"
    path.write_text('model-layout = "data_parallel"\nbucket-cap-mb = 50\nstatic-graph = true\n'
                    'gradient-as-bucket-view = false\ncomm-hook = "powersgd"\n'
                    'powersgd-rank = 2\n')
    cfg = parse_args(["--config", str(path)], SETTINGS)
    assert (cfg.bucket_cap_mb, cfg.static_graph, cfg.gradient_as_bucket_view) == (50.0, True, False)
    assert (cfg.comm_hook, cfg.powersgd_rank) == ("powersgd", 2)
    cfg = parse_args(["--config", str(path), "--comm-hook", "none"], SETTINGS)
    assert cfg.comm_hook == "none"


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('epochs = 7\nbatch-size = 8\nlr = 1e-4\nno-progress = true\n'
                    'stage-devices = ["cpu", "cpu"]\nmodel-layout = "model_parallel_2"\n')
    cfg = parse_args(["--config", str(path), "--epochs", "2"], SETTINGS)
    assert (cfg.epochs, cfg.batch_size, cfg.lr, cfg.progress) == (2, 8, 1e-4, False)
    assert cfg.stage_devices == ["cpu", "cpu"] and cfg.config == str(path)


@pytest.mark.parametrize("text, says", [
    ("learning-rate = 0.1", "unknown key 'learning-rate'"),
    ('epochs = "three"', "key 'epochs' must be an integer, got 'three'"),
    ("epochs = 2.5", "key 'epochs' must be an integer, got 2.5"),
    ("lr = true", "key 'lr' must be a number, got True"),
    ("compile = 1", "key 'compile' must be true or false, got 1"),
    ("epochs = 0", "key 'epochs': must be at least 1"),
    ('precision = "fp8"', "key 'precision' must be one of fp32, bf16, fp16"),
    ("local-rank = 1", "unknown key 'local-rank'"),
    ("epochs = ", "not a readable TOML file"),
])
def test_bad_config_files_exit_2_naming_the_key(tmp_path, text, says, capsys):
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(path)], SETTINGS)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and says in lines[0], lines


def test_the_example_config_trains_and_the_resolved_values_are_saved(workdir):
    config = PROJECT_ROOT / "configs/example.toml"
    ok(python_train(["--config", str(config), "--epochs", "1", "--dataset-size", "64"], workdir))
    saved = json.loads((workdir / "runs/latest/config.json").read_text())
    assert saved["epochs"] == 1 and saved["config"] == str(config)
    assert saved["lr_schedule"] == parse_args(["--config", str(config)], SETTINGS).lr_schedule
    assert summary(workdir / "runs/latest")["epochs_completed"] == 1


def test_plain_python_is_a_world_of_one(workdir):
    ok(python_train(["--epochs", "1", "--dataset-size", "256", "--batch-size", "32"], workdir))
    done = summary(workdir / "runs/latest")
    assert done["world_size"] == 1 and done["launcher"] == "none" and done["steps"] == 8


def test_a_setting_that_does_nothing_with_another_flag_is_a_warning(tmp_path, capsys,
                                                                   example_task):
    data = tmp_path / "data"
    data.mkdir()
    parse_args(["--data", str(data), "--dataset-size", "10"], SETTINGS)
    assert f"warning: --dataset-size 10 has no effect with --data {data}" in capsys.readouterr().err
    parse_args(["--data", str(data)], SETTINGS)  # left at its default: nothing to say
    parse_args(["--dataset-size", "10"], SETTINGS)
    assert "warning" not in capsys.readouterr().err


def test_ddp_flags_that_do_nothing_with_the_other_answers_are_warnings(capsys):
    parse_args(["--model-layout", "fsdp", "--bucket-cap-mb", "50", "--comm-hook", "bf16"],
               SETTINGS)
    assert capsys.readouterr().err.splitlines() == [
        "warning: --bucket-cap-mb has no effect with --model-layout fsdp (FSDP exchanges "
        "gradients itself, without DDP)",
        "warning: --comm-hook has no effect with --model-layout fsdp (FSDP exchanges gradients "
        "itself, without DDP)"]
    parse_args(["--model-layout", "data_parallel", "--powersgd-rank", "4"], SETTINGS)
    assert capsys.readouterr().err.splitlines() == [
        "warning: --powersgd-rank has no effect without --comm-hook powersgd"]
    cfg = parse_args(["--model-layout", "data_parallel", "--comm-hook", "powersgd",
                      "--powersgd-rank", "4", "--static-graph"], SETTINGS)
    assert capsys.readouterr().err == ""
    assert (cfg.comm_hook, cfg.powersgd_rank, cfg.static_graph) == ("powersgd", 4, True)
    assert cfg.gradient_as_bucket_view and cfg.bucket_cap_mb is None  # the defaults (DDP's)


def test_the_scripts_read_relative_paths_from_where_they_ran(tmp_path, monkeypatch):
    """doctor.absolute_paths, which train_local.sh and train_multinode.sh pass the flags through:
    each relative path given, --init-method's store file too, is read from the caller's folder;
    words and URLs stay as they are."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "images").mkdir()  # --data is checked to exist
    cfg = parse_args(["--init-method", "rdzv/store", "--output-dir", "runs", "--resume", "auto",
                      "--data", "images"], None, warn=False)
    flags = absolute_paths(cfg)
    assert dict(zip(flags[::2], flags[1::2], strict=True)) == {
        "--init-method": str(tmp_path / "rdzv/store"), "--output-dir": str(tmp_path / "runs"),
        "--data": str(tmp_path / "images")}
    assert cfg.init_method == str(tmp_path / "rdzv/store")
    for method in ("env", "tcp", "file", "tcp://127.0.0.1:29500", "file:///x/store"):
        assert absolute_paths(parse_args(["--init-method", method], None, warn=False)) == []


def test_run_name_puts_outputs_and_checkpoints_in_folders_of_their_own():
    cfg = parse_args(["--run-name", "lr-sweep-1"], SETTINGS)
    assert (cfg.output_dir, cfg.checkpoint_dir) == ("runs/lr-sweep-1", "checkpoints/lr-sweep-1")
    cfg = parse_args(["--run-name", "a", "--output-dir", "elsewhere"], SETTINGS)  # given: it wins
    assert (cfg.output_dir, cfg.checkpoint_dir) == ("elsewhere", "checkpoints/a")
    cfg = parse_args([], SETTINGS)
    assert (cfg.output_dir, cfg.checkpoint_dir) == ("runs/latest", "checkpoints")
    with pytest.raises(SystemExit):
        parse_args(["--run-name", "../up"], SETTINGS)


def test_keep_best_and_early_stop_say_which_way_is_better(capsys):
    def parse(argv: list[str]) -> Config:
        return parse_args(argv, SETTINGS)

    assert parse(["--keep-best", "val_accuracy:max"]).keep_best == "val_accuracy:max"
    assert parse(["--keep-best", "loss"]).keep_best == "loss"  # a loss: lower is better
    assert parse(["--early-stop", "val_loss:3"]).early_stop == "val_loss:3"
    for flags, says in ((["--keep-best", "val_accuracy"], "val_accuracy:max or val_accuracy:min"),
                        (["--keep-best", "val_accuracy:up"], "expected METRIC, METRIC:max"),
                        (["--early-stop", "val_loss"], "expected METRIC[:max|min]:PATIENCE"),
                        (["--early-stop", "val_loss:0"], "PATIENCE at least 1")):
        with pytest.raises(SystemExit):
            parse(flags)
        assert says in capsys.readouterr().err
