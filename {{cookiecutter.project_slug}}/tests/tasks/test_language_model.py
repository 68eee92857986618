"""Tests of the example task in task.py: a small transformer predicting the next byte of text.

They check this example learns and that its text-file format works. When you replace task.py with
your own task, replace these with tests of yours; every other test keeps working.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from array import array
from pathlib import Path

import pytest
import torch
from conftest import (
    PROJECT_ROOT,
    load_state,
    ok,
    one_error,
    python_train,
    read_metrics,
    run_cmd,
    summary,
    torchrun,
)

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints
from {{ cookiecutter.package_name }}.config import parse_args
from {{ cookiecutter.package_name }}.failures import UsageError


def doc_inputs(root: Path) -> list[str]:
    """What the docs' commands read (tests/test_doc_commands.py): docs/data.md's text, and
    prompts for scripts/predict.py's INPUT."""
    (root / "data").mkdir(exist_ok=True)
    (root / "data/corpus.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 400)
    return ["To be", "The "]


def test_perplexity_falls_far_below_guessing(workdir):
    ok(torchrun(["--dataset-size", "1024", "--epochs", "3", "--lr", "0.005"], workdir))
    losses = [m["loss"] for m in read_metrics(workdir / "runs/latest")]
    assert losses[-1] < 0.5 * losses[0], "the training loss did not fall"
    final = read_metrics(workdir / "runs/latest", "val_loss")[-1]
    # Guessing among the 256 byte values: 256; the letters' frequencies alone: about 14.
    assert final["val_perplexity"] < 7


def test_text_file_is_read_one_window_at_a_time_by_worker_processes(workdir):
    text = b"the quick brown fox jumps over the lazy dog. " * 400
    (workdir / "corpus.txt").write_bytes(text)
    ok(torchrun(["--data", "corpus.txt", "--num-workers", "2", "--epochs", "2", "--lr", "0.005"],
                workdir))
    final = read_metrics(workdir / "runs/latest", "val_loss")[-1]
    assert final["val_perplexity"] < 4
    windows = task.TextWindows(workdir / "corpus.txt", 64)
    assert len(windows) == (len(text) - 1) // 64
    assert bytes(windows[1].tolist()) == text[64:2 * 64 + 1]


def test_nanogpt_token_files_are_read_as_uint16_ids(tmp_path):
    """nanoGPT's train.bin: GPT-2's ids as uint16, read as tokens (not as text), and an id beyond
    --vocab-size is one line naming the size that fits, not an index error in the embedding; a
    prediction, which needs the tokenizer that made the ids, one line too."""
    ids = torch.randint(50257, (1000,), generator=torch.Generator().manual_seed(0))
    (tmp_path / "train.bin").write_bytes(array("H", ids.tolist()).tobytes())
    cfg = parse_args(["--data", str(tmp_path / "train.bin"), "--vocab-size", "50304",
                      "--val-fraction", "0.1"], task.Settings)
    train, val = task.build_datasets(cfg)
    assert len(train) + len(val) == (1000 - 1) // 64
    assert torch.equal(train.dataset[2], ids[128:128 + 65])
    with pytest.raises(UsageError, match=r"token id \d+ is beyond --vocab-size 256; GPT-2's ids "
                                         r"\(nanoGPT's .bin files\) need 50304"):
        task.TextWindows(tmp_path / "train.bin", 64)  # before any window is read
    # One bad id, the file's last: found before the first step, not when its window is read.
    (tmp_path / "late.bin").write_bytes(array("H", [7] * 999 + [300]).tobytes())
    with pytest.raises(UsageError, match="token id 300 is beyond --vocab-size 256"):
        task.TextWindows(tmp_path / "late.bin", 64)
    with pytest.raises(UsageError, match="only the tokenizer that made the .bin file turns"):
        task.predict(None, ["a prompt"], cfg)  # ids this project cannot turn into text


def test_what_a_token_file_cannot_hold_is_one_line_before_the_first_step(tmp_path):
    """nanoGPT's format is uint16 ids and nothing else: 32-bit ids, a text file named .bin and an
    odd byte count are each one line (each trained garbage before); .BIN is a token file too."""
    ids = list(range(100, 1100))
    (tmp_path / "upper.BIN").write_bytes(array("H", ids).tobytes())
    assert task.TextWindows(tmp_path / "upper.BIN", 64, 2048)[1].tolist() == ids[64:129]
    with pytest.raises(UsageError, match="only the tokenizer that made the .bin file turns"):
        task.predict(None, ["a prompt"], parse_args(["--data", str(tmp_path / "upper.BIN")],
                                                    task.Settings))
    (tmp_path / "int32.bin").write_bytes(array("i", ids).tobytes())
    with pytest.raises(UsageError, match=r"int32.bin: every second uint16 is 0: 32- or 64-bit "
                                         r"token ids, not uint16; write uint16 ids, as nanoGPT "
                                         r"does: np.array\(ids, dtype=np.uint16\)"):
        task.TextWindows(tmp_path / "int32.bin", 64, 2048)
    (tmp_path / "notes.bin").write_text("the quick brown fox jumps over the lazy dog.\n" * 50)
    with pytest.raises(UsageError, match=r"notes.bin: text, not token ids \(a .bin file holds "
                                         r"uint16 ids\); rename it notes.txt"):
        task.TextWindows(tmp_path / "notes.bin", 64, 50304)
    (tmp_path / "odd.bin").write_bytes(array("H", ids).tobytes() + b"\x01")
    with pytest.raises(UsageError, match="odd.bin: 2001 bytes, an odd number: not whole uint16"):
        task.TextWindows(tmp_path / "odd.bin", 64, 2048)


def test_a_token_file_replaced_between_runs_is_not_resumed_as_the_same(tmp_path):
    """The checkpoint records the .bin file's size and checksum: other ids at the same path (a
    file written again) are one line, not a resume at the old file's position."""
    ids = torch.randint(256, (3000,), generator=torch.Generator().manual_seed(0))
    (tmp_path / "train.bin").write_bytes(array("H", ids.tolist()).tobytes())
    flags = ["--data", "train.bin", "--max-steps", "4", "--save-every-steps", "2"]
    ok(python_train([*flags, "--max-steps", "2"], tmp_path))
    (tmp_path / "train.bin").write_bytes(array("H", ids.flip(0).tolist()).tobytes())
    line = one_error(python_train(flags, tmp_path))
    assert "was trained on --data train.bin: 6000 bytes, sha256 " in line
    assert "give that file again, --resume weights-only to go on from its weights" in line
    ok(python_train([*flags, "--resume", "weights-only"], tmp_path))


def test_a_file_shorter_than_two_windows_is_one_error_line(workdir):
    (workdir / "tiny.txt").write_bytes(b"too short")
    result = torchrun(["--data", "tiny.txt", "--epochs", "1"], workdir)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    assert "this model needs at least 129" in errors[0]


def test_predict_continues_each_prompt(workdir):
    ok(python_train(["--epochs", "1", "--dataset-size", "64", "--hidden-size", "16"], workdir))
    newest = max((workdir / "checkpoints").glob("ckpt_step*"))  # a file, or a folder (fsdp)
    result = ok(run_cmd([sys.executable, str(PROJECT_ROOT / "scripts/predict.py"), str(newest),
                         "the ", "data"], workdir))
    # Each prompt, continued (a continuation may hold line breaks of its own).
    assert result.stdout.startswith("the ") and "\ndata" in result.stdout
    assert len(result.stdout) > len("the \ndata\n") + 40


def test_the_gpt2_small_preset_is_124m_parameters_and_half_a_million_tokens_a_step(capsys):
    cfg = parse_args(["--config", str(PROJECT_ROOT / "configs/gpt2-small.toml"), "--model-layout",
                      "data_parallel"], task.Settings)
    assert cfg.batch_size * cfg.grad_accum * task.tokens_per_sample(cfg) == 524_288
    assert (cfg.precision, cfg.compile) == ("bf16", True)
    with torch.device("meta"):  # sizes only: no memory
        model = task.build_model(cfg)
    # On a CPU it says at once that this is a GPU's work (a first step takes many minutes there).
    said = "warning: a step is 448 TFLOP a process, a GPU's work (configs/gpt2-small.toml"
    assert (said in capsys.readouterr().err) is not torch.cuda.is_available()
    assert model.head.weight is model.embed.weight
    params = sum(p.numel() for p in model.parameters())
    assert round(params / 1e6, 1) == 124.5  # nanoGPT's GPT-2 small with this vocabulary
    # 6 x (all weights but the position table) + 12 x layers x width x context.
    expected = 6 * (params - 1024 * 768) + 12 * 12 * 768 * 1024
    assert task.flops_per_token(model, cfg) == expected and task.tokens_per_sample(cfg) == 1024


def saved_for_backward(forward) -> list[tuple[torch.dtype, int]]:
    """The dtype and size of each tensor autograd keeps for the backward pass of forward()."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
        loss = forward()
    loss.backward()
    return saved


GPT2_VOCAB = ["--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--seq-len", "32",
              "--vocab-size", "50304"]  # 2 x 32 x 50304 logits outweigh all the rest


def test_the_loss_keeps_no_float32_copy_of_16_bit_logits():
    """At GPT-2's vocabulary a float32 copy of the logits is a third of what the backward pass
    keeps: in bf16 eager, ChunkedCrossEntropy keeps only the bf16 logits (the loss bit for bit,
    the gradients within a bf16 rounding)."""
    model = task.build_model(parse_args(GPT2_VOCAB, task.Settings))
    windows, logits = torch.randint(50304, (2, 33)), 2 * 32 * 50304
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = saved_for_backward(lambda: task.loss_fn(model, windows))
    assert [s for s in kept if s[1] >= logits] == [(torch.bfloat16, logits)]
    x = (3 * torch.randn(300, 50304)).bfloat16().requires_grad_()
    targets, weights = torch.randint(50304, (300,)), torch.rand(300)
    results = []
    for losses in (task.ChunkedCrossEntropy.apply, lambda x, t: torch.nn.functional.cross_entropy(
            x.float(), t, reduction="none")):
        loss = losses(x, targets)
        (loss * weights).sum().backward()
        results.append((loss, x.grad))
        x.grad = None
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=2**-13)


@pytest.mark.compile
@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="no torch.compile here")
def test_the_compiled_loss_keeps_no_float32_copy_of_16_bit_logits():
    """Compiled, the loss is inside the model's graph and inductor fuses the float32 cast."""
    model = torch.compile(task.build_model(parse_args(GPT2_VOCAB, task.Settings)))
    windows, logits = torch.randint(50304, (2, 33)), 2 * 32 * 50304
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = saved_for_backward(lambda: task.loss_fn(model, windows))
    assert [s for s in kept if s[1] >= logits] == [(torch.bfloat16, logits)]


def test_tokens_per_second_and_mfu_are_reported(workdir):
    ok(torchrun(["--dataset-size", "256", "--epochs", "1", "--hidden-size", "32", "--num-heads",
                 "2", "--seq-len", "32", "--log-every", "2"], workdir))
    done, logs = summary(workdir / "runs/latest"), read_metrics(workdir / "runs/latest")
    for record in [done, *logs]:  # samples/s are rounded to 0.1
        assert record["tokens_per_s"] == pytest.approx(32 * record["samples_per_s"], abs=2)
    # MFU needs the device's peak: known for some GPUs, never for a CPU.
    assert done["mfu"] is None and all(r["mfu"] is None for r in logs)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                    reason='needs Hugging Face tokenizers: pip install -e ".[shards]"')
def test_text_prepared_as_token_shards_trains_and_another_tokenizer_is_refused(workdir, capsys):
    """docs/data.md: a byte-level BPE trained offline on the text, its shards in a folder (a
    re-run does nothing, another source is refused); the model's vocabulary follows the tokenizer
    (padded to 64), predict decodes with it, and a checkpoint resumed on a set of another
    tokenizer is one line."""
    from {{ cookiecutter.package_name }}.failures import UsageError
    from {{ cookiecutter.package_name }}.shards.write import prepare
    words = "the cat sat on a mat while dogs ran over hills and birds sang in trees".split()
    g = torch.Generator().manual_seed(0)
    lines = (" ".join(words[i] for i in torch.randint(len(words), (12,), generator=g).tolist())
             for _ in range(1500))
    (workdir / "corpus.txt").write_text("\n".join(lines))

    def shards(dest: str, vocab: int) -> dict:
        said = ok(run_cmd([sys.executable, "-m", "{{ cookiecutter.package_name }}.shards",
                           "corpus.txt", dest, "--vocab-size", str(vocab), "--shard-mb", "0.02",
                           "--no-progress"], workdir))
        index = json.loads((workdir / dest / "index.json").read_text())
        assert f"wrote {sum(s['samples'] for s in index['shards'])} tokens in" in said.stdout
        return index

    index = shards("tokens", 300)
    assert index["kind"] == "tokens" and len(index["shards"]) > 1
    assert prepare(str(workdir / "corpus.txt"), str(workdir / "tokens"), 1) == index
    assert " tokens in " in capsys.readouterr().out
    (workdir / "more.txt").write_text("more text")
    with pytest.raises(UsageError, match="tokens is a shard set made from .*corpus.txt, not "):
        prepare(str(workdir / "more.txt"), str(workdir / "tokens"), 1)
    assert (workdir / "tokens" / "tokenizer.json").is_file()
    flags = ["--data", "tokens", "--seq-len", "32", "--hidden-size", "32", "--batch-size", "8",
             "--max-steps", "20", "--log-every", "5", "--lr", "0.01"]
    ok(python_train(flags, workdir))
    newest = list_checkpoints(workdir / "checkpoints")[0]
    assert load_state(newest)["model"]["embed.weight"].shape[0] == 320  # 300 tokens, padded
    losses = [m["loss"] for m in read_metrics(workdir / "runs/latest")]
    assert losses[-1] < 0.8 * losses[0]
    said = ok(run_cmd([sys.executable, str(PROJECT_ROOT / "scripts/predict.py"), str(newest),
                       "the cat"], workdir))
    assert said.stdout.startswith("the cat")

    assert shards("other", 290)["tokenizer"] != index["tokenizer"]  # also padded to 320
    flags[1] = "other"
    refused = python_train([*flags, "--max-steps", "30"], workdir)  # refused before "resumed"
    assert "another tokenizer" in one_error(refused) and "resumed from" not in refused.stdout
