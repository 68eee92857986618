"""Every task x model_layout a user can answer trains: each pair is baked and its README's
quickstart runs as written, for one short epoch (the system Python's torch, the bake's own folder
on the path). hf_causal_lm's quickstart names a model folder and a text: a tiny Llama and its BPE
tokenizer, made here offline once, and a text of made-up words stand in for them. The template's
other tests check that a pairwise set of answers bakes and passes its own tests; this one checks
that no valid answer bakes a project whose first command fails."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import CHOICES, PYTHON, answers_id, check_ok, is_valid, run
from test_generated_runs import bake_to, quickstart

PAIRS = [{"task": task, "model_layout": layout}
         for task in CHOICES["task"] for layout in CHOICES["model_layout"]]
# One short epoch: the synthetic data set of every task is small with --dataset-size; the
# Hugging Face task's text is small itself.
SHORT = "--epochs 1 --dataset-size 128 --no-progress"
HF_SHORT = "--epochs 1 --seq-len 32 --no-progress"


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory) -> Path:
    """model/: a tiny Llama (4 heads, 2 key/value heads: tensor_parallel's 2 ranks split them)
    with a byte-level BPE tokenizer, as save_pretrained writes them; text.txt: made-up words."""
    pytest.importorskip("transformers", reason="pip install -r requirements-dev.txt")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("hf")
    g = torch.Generator().manual_seed(0)
    words = ["".join("etaoinshrdlu"[i] for i in torch.randint(12, (int(n),), generator=g))
             for n in torch.randint(2, 7, (24,), generator=g)]
    lines = [" ".join(words[i] for i in torch.randint(24, (12,), generator=g).tolist()) + "."
             for _ in range(800)]
    (folder / "text.txt").write_text("\n".join(lines) + "\n")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return folder


@pytest.mark.parametrize("answers", PAIRS, ids=answers_id)
def test_the_quickstart_of_every_task_and_layout_trains(tmp_path, answers, request):
    assert is_valid(answers), f"{answers}: a pair a user can answer, which the hook refuses"
    project = bake_to(tmp_path, **answers)
    lines = quickstart((project / "README.md").read_text())
    train = next(line for line in lines if line.startswith("scripts/train_local.sh"))
    command = train.replace("--epochs 3", SHORT)
    if answers["task"] == "hf_causal_lm":  # the README's placeholders: your model, your text
        hf = request.getfixturevalue("hf_model")
        command = train.replace("--epochs 3", HF_SHORT).replace(
            "path/to/model", str(hf / "model")).replace("path/to/text.txt", str(hf / "text.txt"))
        assert "path/to" not in command, f"the quickstart's command changed: {train}"
    assert command != train, f"the quickstart's command changed: {train}"
    result = run(["bash", "-c", command], project, timeout=300, PYTHON=PYTHON,
                 HF_HUB_OFFLINE="1",
                 PYTHONPATH=f"{project}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    check_ok(result)
    summary = json.loads((project / "runs/latest/summary.json").read_text())
    assert summary["model_layout"] == answers["model_layout"], summary
    assert summary["epochs_completed"] == 1 and summary["world_size"] == 2, summary
