"""Tests of the example task in task.py: a Hugging Face causal language model from a local folder.

A tiny Llama (2 layers, 4 heads, 2 key/value heads) and a byte-level BPE tokenizer are made here,
offline, in a folder as save_pretrained writes it, with a text of made-up words; every run has
HF_HUB_OFFLINE=1. They check that it learns on 2 processes, resumes bit for bit after a SIGKILL,
exports to a folder transformers loads, and trains under fsdp. When you replace task.py with your
own task, replace these with tests of yours; every other test keeps working.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    TRAIN,
    assert_same_model,
    final_model,
    kill_a_worker_once_saved,
    load_state,
    made_once,
    needs_numpy,
    ok,
    one_error,
    python_train,
    read_metrics,
    run_cmd,
    summary,
    torchrun,
    torchrun_cmd,
)

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints
from {{ cookiecutter.package_name }}.config import parse_args
from {{ cookiecutter.package_name }}.failures import UsageError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason='needs transformers: pip install -e ".[dev]"')

OFFLINE = {"HF_HUB_OFFLINE": "1"}
# 2 x 16 windows of 33 tokens a step; a checkpoint every 10 steps.
FLAGS = ["--seq-len", "32", "--batch-size", "16", "--max-steps", "40", "--save-every-steps", "10",
         "--log-every", "10", "--lr", "0.003", "--val-fraction", "0.05"]


@pytest.fixture(autouse=True, scope="module")
def offline():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


def made_up_text(words: int, seed: int = 0) -> str:
    """Sentences of made-up words, one a line: a model that learns them beats guessing."""
    g = torch.Generator().manual_seed(seed)
    letters = "etaoinshrdlucmfw"
    vocabulary = ["".join(letters[i] for i in torch.randint(len(letters), (int(n),), generator=g))
                  for n in torch.randint(2, 7, (32,), generator=g)]
    picks = torch.randint(len(vocabulary), (words,), generator=g).tolist()
    lines = (" ".join(vocabulary[i] for i in picks[at:at + 12]) + "." for at in range(0, words, 12))
    return "\n".join(lines) + "\n"


def make_model_folder(folder: Path) -> None:
    """model/: a tiny Llama and its BPE tokenizer (eos <|endoftext|>); text.txt: ~300 KB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    text = made_up_text(60_000)
    (folder / "text.txt").write_text(text)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>")
    eos = tokenizer.eos_token_id
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    """A folder with model/ (the tiny Llama's folder) and text.txt."""
    return made_once(tmp_path_factory, "hf-model", make_model_folder)


def flags(hf: Path, *extra: str) -> list[str]:
    return ["--model", str(hf / "model"), "--data", str(hf / "text.txt"), *FLAGS, *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, hf) -> Path:
    """2 processes fine-tune the tiny Llama for 40 steps: checkpoints/ and runs/ in the folder."""
    def train(folder: Path) -> None:
        ok(torchrun(flags(hf), folder, timeout=300, **OFFLINE))

    return made_once(tmp_path_factory, "hf-trained", train)


def test_two_processes_fine_tune_it_and_the_loss_falls(trained):
    losses = [m["loss"] for m in read_metrics(trained / "runs/latest")]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
    final = read_metrics(trained / "runs/latest", "val_loss")[-1]
    assert final["val_perplexity"] < len("etaoinshrdlucmfw") ** 2  # far below the start
    done = summary(trained / "runs/latest")
    assert done["world_size"] == 2 and done["tokens_per_s"] > 0


def test_a_killed_worker_restarts_and_ends_bit_for_bit(trained, hf, tmp_path):
    """torchrun --max-restarts=1: a worker SIGKILLed after the step-10 checkpoint; the restarted
    group resumes from it and ends with the uninterrupted run's weights."""
    command = [*torchrun_cmd(2, "--max-restarts=1"), TRAIN, "--no-progress", *flags(hf)]
    kill_a_worker_once_saved(command, tmp_path, tmp_path / "checkpoints", step=10, **OFFLINE)
    assert summary(tmp_path / "runs/latest")["resumed_from"]
    assert_same_model(final_model(trained / "checkpoints"), final_model(tmp_path / "checkpoints"))


def test_the_export_is_a_folder_transformers_loads_with_the_same_logits(trained, hf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    newest = list_checkpoints(trained / "checkpoints")[0]  # a file, or a folder (fsdp)
    out = tmp_path / "exported"
    ok(run_cmd([sys.executable, "-m", "{{ cookiecutter.package_name }}.checkpoint", "export",
                str(newest), str(out)], tmp_path, **OFFLINE))
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("fw ta.")["input_ids"] == AutoTokenizer.from_pretrained(
        hf / "model")("fw ta.")["input_ids"]
    state = load_state(newest)["model"]
    assert_same_model(state, exported.state_dict())
    model = task.build_model(parse_args(["--model", str(hf / "model")], task.Settings))
    model.load_state_dict(state)
    batch = torch.randint(len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=batch).logits, model.eval()(input_ids=batch).logits)


def test_tied_embeddings_stay_one_tensor_in_the_run_the_checkpoint_and_the_export(hf, tmp_path):
    """Llama 3.2, Qwen2.5's small models and GPT-2 share the token table with the output layer
    (tie_word_embeddings): trained as one tensor, saved under both names, exported tied; its
    FLOPs count the table once, as the output layer's matrix product."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(hf / "model")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tied")
    AutoTokenizer.from_pretrained(hf / "model").save_pretrained(tmp_path / "tied")
    ok(torchrun(["--model", str(tmp_path / "tied"), "--data", str(hf / "text.txt"), *FLAGS,
                 "--max-steps", "10"], tmp_path, timeout=300, **OFFLINE))
    newest = list_checkpoints(tmp_path / "checkpoints")[0]
    state = load_state(newest)["model"]
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    first = AutoModelForCausalLM.from_pretrained(tmp_path / "tied").lm_head.weight
    assert not torch.equal(state["lm_head.weight"], first)  # trained
    ok(run_cmd([sys.executable, "-m", "{{ cookiecutter.package_name }}.checkpoint", "export",
                str(newest), str(tmp_path / "exported")], tmp_path, **OFFLINE))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    assert torch.equal(exported.lm_head.weight, state["lm_head.weight"])
    cfg = parse_args(["--model", str(tmp_path / "tied"), "--seq-len", "32"], task.Settings)
    model = task.build_model(cfg)
    weights = sum(p.numel() for p in model.parameters())  # the shared table once
    assert task.flops_per_token(model, cfg) == 6 * weights + 12 * 2 * 4 * 8 * 32


def test_predict_continues_each_prompt(trained, hf):
    newest = list_checkpoints(trained / "checkpoints")[0]
    script = Path(task.__file__).parents[1] / "scripts/predict.py"
    result = ok(run_cmd([sys.executable, str(script), str(newest), "fw ta", "e"], trained,
                        **OFFLINE))
    # Each prompt, continued (a continuation may hold line breaks of its own).
    assert result.stdout.startswith("fw ta") and "\ne" in result.stdout
    assert len(result.stdout) > len("fw ta\ne\n") + 20


def test_a_missing_model_folder_offline_is_one_error_line(hf, tmp_path):
    result = torchrun(["--model", "no/such/model", "--data", str(hf / "text.txt")], tmp_path,
                      **OFFLINE)
    line = one_error(result)
    assert "--model no/such/model: no such folder" in line and "HF_HUB_OFFLINE=1" in line
    assert "hf download no/such/model --local-dir DIR" in line


@pytest.mark.full
@pytest.mark.fsdp
@needs_numpy
def test_fsdp_with_activation_checkpointing_trains_layer_by_layer(hf, tmp_path):
    said = ok(torchrun(flags(hf, "--model-layout", "fsdp", "--activation-checkpointing"),
                       tmp_path, timeout=300, **OFFLINE))
    assert "note: fsdp shards" not in said.stdout  # each decoder layer a unit of its own
    losses = [m["loss"] for m in read_metrics(tmp_path / "runs/latest")]
    assert losses[-1] < 0.8 * losses[0], losses
    assert list_checkpoints(tmp_path / "checkpoints")[0].is_dir()  # fsdp's DCP folders


# Only a model_layout=tensor_parallel bake has the layout (its module, its flags).
NO_TENSOR_PARALLEL = "this bake has no tensor_parallel layout (model_layout=tensor_parallel has)"


@pytest.mark.full
@pytest.mark.skipif(importlib.util.find_spec("{{ cookiecutter.package_name }}.tensor_parallel")
                    is None, reason=NO_TENSOR_PARALLEL)
@pytest.mark.skipif(torch.__version__ < "2.9", reason="tensor_parallel over gloo needs torch 2.9")
def test_tensor_parallel_two_by_two_learns_as_one_process_and_resumes(hf, tmp_path):
    """4 processes, 2 x 2: the plan from the model's config splits its heads and MLP over 2 ranks,
    a worker is SIGKILLed after the step-10 checkpoint and the group restarts from it. Its losses
    and its final weights are those of one process with the same global batch (4 x 8 windows)."""
    run = ["--max-steps", "20", "--log-every", "2"]
    two_by_two = [*torchrun_cmd(4, "--max-restarts=1"), TRAIN, "--no-progress",
                  *flags(hf, *run, "--model-layout", "tensor_parallel", "--tp-size", "2",
                         "--batch-size", "8", "--checkpoint-dir", "tp", "--output-dir", "runs/tp")]
    kill_a_worker_once_saved(two_by_two, tmp_path, tmp_path / "tp", step=10, worker=3, **OFFLINE)
    ok(python_train(flags(hf, *run, "--model-layout", "data_parallel", "--batch-size", "32",
                          "--checkpoint-dir", "one", "--output-dir", "runs/one"),
                    tmp_path, timeout=300, **OFFLINE))
    # The kill follows step 10's save: the restarted group resumed from it (or a later one saved
    # meanwhile), with steps left to train.
    resumed = summary(tmp_path / "runs/tp")["resumed_from"]
    assert any(resumed.endswith(f"ckpt_step{step:08d}") for step in range(10, 20)), resumed
    for key, steps in (("loss", set(range(2, 21, 2))), ("val_loss", {20})):
        # The restarted run logs again the steps after step 10: the last record of a step counts.
        tp = {m["step"]: m[key] for m in read_metrics(tmp_path / "runs/tp", key)}
        one = {m["step"]: m[key] for m in read_metrics(tmp_path / "runs/one", key)}
        assert tp.keys() == one.keys() == steps, (tp, one)
        assert list(tp.values()) == pytest.approx(list(one.values()), rel=1e-4), key
    one, tp = final_model(tmp_path / "one"), final_model(tmp_path / "tp")
    assert tp.keys() == one.keys()
    for name, weight in one.items():
        assert torch.allclose(tp[name], weight, atol=1e-4), name


def test_a_shard_set_prepared_with_the_models_tokenizer_trains(hf, tmp_path):
    """prepare --tokenizer MODEL stores the model's own ids (no start token a line, its
    end-of-text token after each file), 2 processes fine-tune on the set, and a set another
    tokenizer made is one line before the first step."""
    from transformers import AutoTokenizer

    from {{ cookiecutter.package_name }}.shards.write import prepare

    index = prepare(str(hf / "text.txt"), str(tmp_path / "set"), 0.1, str(hf / "model"),
                    progress=False)
    assert index["dtype"] == "uint16" and len(index["shards"]) > 1
    tokenizer = AutoTokenizer.from_pretrained(hf / "model")
    expected = tokenizer((hf / "text.txt").read_text(), add_special_tokens=False)["input_ids"]
    stored = b"".join((tmp_path / "set" / f"{shard['name']}.bin").read_bytes()
                      for shard in index["shards"])
    assert torch.frombuffer(bytearray(stored), dtype=torch.uint16).tolist() == [
        *expected, tokenizer.eos_token_id]
    ok(torchrun(["--model", str(hf / "model"), "--data", str(tmp_path / "set"), *FLAGS[:2],
                 "--batch-size", "16", "--max-steps", "20", "--log-every", "10", "--lr", "0.003"],
                tmp_path, timeout=300, **OFFLINE))
    losses = [m["loss"] for m in read_metrics(tmp_path / "runs/latest")]
    assert len(losses) == 2 and losses[-1] < 0.8 * losses[0], losses
    prepare(str(hf / "text.txt"), str(tmp_path / "other"), 0.1, None, 400, progress=False)
    with pytest.raises(UsageError, match=r"other: its tokens are another tokenizer's \(\d+ "
                                         r"tokens\) than --model's \(320\); prepare it with "
                                         r"the model's tokenizer: python -m .*--tokenizer "):
        task.build_datasets(parse_args(["--model", str(hf / "model"), "--data",
                                        str(tmp_path / "other")], task.Settings))


def test_a_tokenizer_without_its_end_of_text_token_is_one_line(hf, tmp_path):
    """prepare puts the end-of-text token between documents: a model folder whose eos_token its
    tokenizer.json lacks, or a tokenizer.json without <|endoftext|>, is refused (they were
    written with nothing between documents)."""
    import shutil

    from tokenizers import Tokenizer, models

    from {{ cookiecutter.package_name }}.shards.write import prepare

    shutil.copytree(hf / "model", tmp_path / "model")
    settings = tmp_path / "model/tokenizer_config.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "eos_token": "<|end|>"}))
    with pytest.raises(UsageError, match=r"model: '<\|end\|>', the token put between "
                                         r"documents, is not in its tokenizer.json; set "
                                         r"eos_token in its tokenizer_config.json"):
        prepare(str(hf / "text.txt"), str(tmp_path / "set"), 1, str(tmp_path / "model"),
                progress=False)
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "t.json"))
    with pytest.raises(UsageError, match=r"t.json: '<\|endoftext\|>', the token put between "
                                         r"documents, is not in its t.json; add <\|endoftext"):
        prepare(str(hf / "text.txt"), str(tmp_path / "set"), 1, str(tmp_path / "t.json"),
                progress=False)
    assert not (tmp_path / "set").exists()


def test_a_vocabulary_past_65535_is_stored_and_read_whole(tmp_path):
    """A model folder whose tokenizer has 70,000 tokens: prepare stores int32 ids, and the task's
    windows hold the ids past 65,535 as they are."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from {{ cookiecutter.package_name }}.shards.write import prepare

    words = {f"w{i}": i for i in range(70_000)}
    word_level = Tokenizer(models.WordLevel(words, unk_token="w0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="w69999").save_pretrained(
        tmp_path / "model")
    (tmp_path / "text.txt").write_text(" ".join(f"w{65_530 + i}" for i in range(30)))
    assert prepare(str(tmp_path / "text.txt"), str(tmp_path / "set"), 1, str(tmp_path / "model"),
                   progress=False)["dtype"] == "int32"
    cfg = parse_args(["--model", str(tmp_path / "model"), "--data", str(tmp_path / "set"),
                      "--seq-len", "10", "--val-fraction", "0"], task.Settings)
    train, val = task.build_datasets(cfg)
    assert val is None and [train[i].tolist() for i in range(len(train))] == [
        [65_530 + i for i in range(11)], [65_540 + i for i in range(11)],
        [*range(65_550, 65_560), 69_999]]


def test_text_json_lines_and_folders_are_packed_with_the_end_of_text_token(tmp_path, monkeypatch):
    """Each document followed by the end-of-text id, in windows of --seq-len + 1 ids that overlap
    by one; ids past 65,535 (a large vocabulary's) kept whole."""
    class LargeVocabulary:  # the fake tokenizer of a 100,000-token vocabulary
        eos_token_id = 99_999

        def __call__(self, texts: list[str], **kwargs) -> dict:
            return {"input_ids": [[70_000 + ord(c) for c in text] for text in texts]}

    monkeypatch.setattr(task, "pretrained", lambda kind, name, **kwargs: LargeVocabulary())
    (tmp_path / "data").mkdir()
    (tmp_path / "data/a.txt").write_text("abc")
    (tmp_path / "data/b.jsonl").write_text(json.dumps({"text": "de"}) + "\n\n"
                                           + json.dumps({"text": "f", "id": 2}) + "\n")

    def windows(data: Path, *extra: str) -> list[list[int]]:
        cfg = parse_args(["--model", "m", "--data", str(data), "--seq-len", "3", *extra],
                         task.Settings)
        train, val = task.build_datasets(cfg)
        assert val is None and train.tensors[0].dtype == torch.int64
        return sorted(train.tensors[0].tolist())

    a, b, c, d, e, f = (70_000 + ord(x) for x in "abcdef")
    end = LargeVocabulary.eos_token_id
    assert windows(tmp_path / "data", "--val-fraction", "0") == [[a, b, c, end], [end, d, e, end]]
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n["not", "an", "object"]\n')
    with pytest.raises(UsageError, match=r"bad.jsonl: line 2 is not a JSON object with a \"text\""):
        windows(tmp_path / "bad.jsonl")
    with pytest.raises(UsageError, match="pass --data PATH"):
        task.build_datasets(parse_args(["--model", "m"], task.Settings))
    with pytest.raises(UsageError, match="pass --model PATH"):
        task.build_model(parse_args([], task.Settings))


def test_blocks_plan_and_sizes_come_from_the_models_folder(hf):
    cfg = parse_args(["--model", str(hf / "model"), "--seq-len", "32"], task.Settings)
    with torch.device("meta"):  # as doctor --plan builds it: sizes only, no weights read
        model = task.build_model(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert [type(b).__name__ for b in task.blocks(model)] == ["LlamaDecoderLayer"] * 2
    plan = task.tensor_parallel_plan(model, 2)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and len(plan) == 7
    with pytest.raises(UsageError, match="--tp-size 4 must divide the model's 4 attention heads "
                                         "and 2 key/value heads"):
        task.tensor_parallel_plan(model, 4)
    tensor_parallel = "{{ cookiecutter.package_name }}.tensor_parallel"
    if importlib.util.find_spec(tensor_parallel):  # a bake with the layout: its own check
        layers = importlib.import_module(tensor_parallel).task_plan(model, task, 2)
        assert list(layers.values())[:4] == ["colwise"] * 3 + ["rowwise"] and len(layers) == 14
    weights = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    assert task.flops_per_token(model, cfg) == 6 * weights + 12 * 2 * 4 * 8 * 32
    assert os.environ["HF_HUB_OFFLINE"] == "1"


# ---------------------------------------------------------------------- LoRA (--lora-rank)
# data_parallel in a model_layout=tensor_parallel bake too: tensor_parallel has no plan for peft's
# layers (one line, below).
LORA = ["--lora-rank", "4", "--lr", "0.01", "--model-layout", "data_parallel"]


@pytest.fixture(scope="module")
def lora_trained(tmp_path_factory, hf) -> Path:
    """2 processes train rank-4 LoRA adapters on the tiny Llama for 40 steps."""
    def train(folder: Path) -> None:
        ok(torchrun(flags(hf, *LORA), folder, timeout=300, **OFFLINE))

    return made_once(tmp_path_factory, "hf-lora", train)


def test_lora_trains_and_saves_the_adapters_alone(lora_trained, hf):
    """Only the adapters of the 2 layers' 7 projections train and are in the checkpoints; the
    model starts as the folder's, and the loss falls (slowly: the token tables stay frozen)."""
    losses = [m["loss"] for m in read_metrics(lora_trained / "runs/latest")]
    assert len(losses) == 4 and losses == sorted(losses, reverse=True), losses
    assert losses[-1] < losses[0] - 0.1, losses
    saved = load_state(list_checkpoints(lora_trained / "checkpoints")[0])["model"]
    assert len(saved) == 2 * 7 * 2 and all(".lora_A." in k or ".lora_B." in k for k in saved)
    cfg = parse_args(["--model", str(hf / "model"), "--lora-rank", "4"], task.Settings)
    model = task.build_model(cfg)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(saved)
    from transformers import AutoModelForCausalLM

    folders = AutoModelForCausalLM.from_pretrained(hf / "model")
    batch = torch.randint(320, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # lora_B starts at zero: the folder's model, as it was
        assert torch.equal(model(input_ids=batch).logits, folders(input_ids=batch).logits)


def test_lora_resumes_bit_for_bit_after_a_sigkill(lora_trained, hf, tmp_path):
    command = [*torchrun_cmd(2, "--max-restarts=1"), TRAIN, "--no-progress", *flags(hf, *LORA)]
    kill_a_worker_once_saved(command, tmp_path, tmp_path / "checkpoints", step=10, **OFFLINE)
    assert summary(tmp_path / "runs/latest")["resumed_from"]
    assert_same_model(final_model(lora_trained / "checkpoints"),
                      final_model(tmp_path / "checkpoints"))


def test_lora_exports_merged_or_as_an_adapter_peft_loads(lora_trained, hf, tmp_path):
    """export: a folder transformers loads, the adapters merged into the weights (the same logits,
    to float rounding); --adapter-only: the adapters as a folder peft loads onto --model's model
    (the same logits)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from {{ cookiecutter.package_name }}.checkpoint.export import main as export

    newest = list_checkpoints(lora_trained / "checkpoints")[0]
    assert export(["export", str(newest), str(tmp_path / "merged")]) == 0
    assert export(["export", str(newest), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    model = task.build_model(parse_args(["--model", str(hf / "model"), "--lora-rank", "4"],
                                        task.Settings))
    model.load_state_dict(load_state(newest)["model"], strict=False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf / "model"),
                                        tmp_path / "adapter")
    batch = torch.randint(320, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.eval()(input_ids=batch).logits
        assert not torch.equal(logits, AutoModelForCausalLM.from_pretrained(hf / "model")(
            input_ids=batch).logits)  # the adapters changed it
        assert torch.allclose(merged(input_ids=batch).logits, logits, atol=1e-5)
        assert torch.equal(adapter.eval()(input_ids=batch).logits, logits)
    assert not (tmp_path / "merged/adapter_config.json").exists()


def test_the_plan_holds_every_weight_and_trains_the_adapters_alone(hf):
    """doctor --plan with --lora-rank: every weight is on the GPU, but only the adapters have
    gradients, AdamW's state (2 copies and a step each) and an EMA copy."""
    from {{ cookiecutter.package_name }}.ema import EMA
    from {{ cookiecutter.package_name }}.plan import model_line, static_memory

    cfg = parse_args(["--model", str(hf / "model"), *LORA, "--ema-decay", "0.99"], task.Settings)
    model = task.build_model(cfg)
    adapters = [p.numel() for name, p in model.named_parameters() if ".lora_" in name]
    total = sum(p.numel() for p in model.parameters())
    figures = static_memory(cfg, "data_parallel", 2)[0][0]
    assert figures["parameters"] == 4 * total
    assert figures["gradients"] == 4 * sum(adapters)
    assert figures["EMA weights"] == sum(a.nbytes for a in EMA(model, 0.99).averages)
    assert figures["optimizer state"] == 8 * sum(adapters) + 4 * len(adapters)
    assert f"{total:,} parameters in {len(list(model.parameters()))} tensors ({sum(adapters):,} " \
           "of them train)" in model_line(model, "AdamW", False)


@pytest.mark.full
@pytest.mark.compile
def test_lora_compiled_and_checkpointed_layer_by_layer_learns_the_same(lora_trained, hf, tmp_path):
    """--compile and --activation-checkpointing (each decoder layer recomputed in the backward)
    with the adapters on: the plain LoRA run's losses, and its adapters alone saved. (Their
    values differ by some 1e-4: compiled kernels round otherwise, and AdamW's step follows the
    sign of a gradient near zero.)"""
    ok(torchrun(flags(hf, *LORA, "--compile", "--activation-checkpointing"), tmp_path,
                timeout=300, **OFFLINE))
    plain = [m["loss"] for m in read_metrics(lora_trained / "runs/latest")]
    assert [m["loss"] for m in read_metrics(tmp_path / "runs/latest")] == pytest.approx(
        plain, rel=1e-4)
    saved = load_state(list_checkpoints(tmp_path / "checkpoints")[0])["model"]
    assert saved.keys() == load_state(list_checkpoints(lora_trained / "checkpoints")[0])[
        "model"].keys()


def test_lora_refuses_what_it_cannot_do_in_one_line(hf):
    """--from-scratch has no trained weights to adapt; tensor_parallel has no plan for peft's
    layers; the EMA averages the adapters alone (the rest is rebuilt at every start)."""
    from {{ cookiecutter.package_name }}.ema import EMA

    def cfg(*extra: str):
        return parse_args(["--model", str(hf / "model"), "--lora-rank", "2", *extra],
                          task.Settings)

    with pytest.raises(UsageError, match="--lora-rank adapts the trained weights of --model, "
                                         "and --from-scratch has none"):
        task.build_model(cfg("--from-scratch"))
    model = task.build_model(cfg())
    with pytest.raises(UsageError, match="--lora-rank trains under --model-layout data_parallel "
                                         "or fsdp"):
        task.tensor_parallel_plan(model, 2)
    ema = EMA(model, 0.9)
    assert len(ema.names) == 28 and all(".lora_" in name for name in ema.names)
    assert len(model.rebuilt_weights) == len(model.state_dict()) - 28
    assert not hasattr(task.build_model(parse_args(["--model", str(hf / "model")],
                                                   task.Settings)), "rebuilt_weights")


@pytest.mark.full
@pytest.mark.fsdp
@needs_numpy
def test_lora_under_fsdp_resumes_bit_for_bit_after_a_sigkill(hf, tmp_path):
    """fsdp shards the frozen model and the adapters alike; its checkpoint folders hold the
    adapters alone, and a killed worker's group resumes to the uninterrupted run's adapters."""
    run = flags(hf, *LORA, "--model-layout", "fsdp", "--max-steps", "20")
    for folder in ("whole", "killed"):
        (tmp_path / folder).mkdir()
    ok(torchrun(run, tmp_path / "whole", timeout=300, **OFFLINE))
    command = [*torchrun_cmd(2, "--max-restarts=1"), TRAIN, "--no-progress", *run]
    kill_a_worker_once_saved(command, tmp_path / "killed", tmp_path / "killed/checkpoints",
                             step=10, **OFFLINE)
    assert summary(tmp_path / "killed/runs/latest")["resumed_from"]
    whole = final_model(tmp_path / "whole/checkpoints")
    assert len(whole) == 28 and all(".lora_" in name for name in whole)
    assert_same_model(whole, final_model(tmp_path / "killed/checkpoints"))
