"""make bench-hf: one small Llama fine-tuned by a task=hf_causal_lm project and by
transformers.Trainer, the tool a user would pick instead, on the same work.

    python bench/hf.py               # 3 alternating pairs, 60 steps each
    python bench/hf.py --pairs 5 --steps 100

Both get the same model folder (a Llama of 4 layers, hidden 256, made here offline with its BPE
tokenizer), the same windows (bench/variants/hf_trainer.py builds them with the project's own
task), per-process batch, AdamW learning rate (constant, no clipping, no weight decay) and steps:
2 processes under torchrun with gloo and one thread each on a CPU, one process on a GPU (bf16).
Each run's per-step time is the median of its step ends after the first 20 steps (the project's
StepClock in both). Printed: each run's per-step ms, wall time and validation loss, then
`per-step ours/Trainer: R` (the median of the pairs' ratios). Trainer and its accelerate are
installed into bench/.venv-hf (with the torch already installed); never into the project.
A benchmark: its timings are for reading, and no test asserts them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from run import WARMUP_STEPS, bake, venv_python

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "hf"
SEQ_LEN, BATCH, LR = 128, 8, 3e-4


def hf_python() -> str:
    """bench/.venv-hf's Python: the system's torch and transformers, plus accelerate (Trainer's)."""
    return venv_python(".venv-hf", "accelerate, transformers, tokenizers",
                       ["accelerate", "transformers>=5", "tokenizers"])


MAKE_MODEL = """
import random, sys
from pathlib import Path
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

folder = Path(sys.argv[1])
random.seed(0)
words = ["".join(random.choice("etaoinshrdlucmfwypvbgk") for _ in range(random.randint(2, 9)))
         for _ in range(3000)]
lines = [" ".join(random.choice(words) for _ in range(14)) + "." for _ in range(60000)]
(folder / "text.txt").write_text("\\n".join(lines) + "\\n")
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(lines, trainers.BpeTrainer(
    vocab_size=4096, special_tokens=["<|endoftext|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                    bos_token="<|endoftext|>")
eos = tokenizer.eos_token_id
config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=704,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                     max_position_embeddings=512, bos_token_id=eos, eos_token_id=eos)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config).save_pretrained(folder / "model")
tokenizer.save_pretrained(folder / "model")
"""


def flags(data: Path, steps: int, gpu: bool) -> list[str]:
    """The project's flags, which the Trainer variant reads too."""
    return ["--model", str(data / "model"), "--data", str(data / "text.txt"),
            "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--max-steps", str(steps),
            "--lr", str(LR), "--val-fraction", "0.02", "--no-progress", "--save-every", "0",
            "--resume", "never", "--log-every", str(steps),
            *(["--backend", "nccl", "--precision", "bf16"] if gpu else [])]


def run(name: str, python: str, project: Path, data: Path, work: Path, steps: int,
        gpu: bool) -> dict:
    """One run of `name` (ours or trainer): per-step ms, wall seconds, validation loss."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torchrun = [python, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={1 if gpu else 2}"]
    common = [*flags(data, steps, gpu), "--output-dir", str(work / "runs"),
              "--checkpoint-dir", str(work / "ck")]
    if name == "ours":
        command = [*torchrun, str(project / "train.py"), *common,
                   "--step-times", str(work / "steps.json")]
    else:
        command = [*torchrun, str(HERE / "variants" / "hf_trainer.py"), *common,
                   "--result", str(work / "steps.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(project)}
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    result_file = work / "steps.json"
    # Trainer's gloo group can abort a rank at exit after its work is done: its results count.
    if not result_file.exists():
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(result_file.read_text())
    ends = result["step_ends"]
    ms = [1000 * (b - a) for a, b in zip(ends, ends[1:], strict=False)][WARMUP_STEPS:]
    if name == "ours":
        evaluations = [json.loads(line) for line in
                       (work / "runs/metrics.jsonl").read_text().splitlines()]
        val_loss = [m["val_loss"] for m in evaluations if "val_loss" in m][-1]
    else:
        val_loss = result["val_loss"]
    return {"step_ms": statistics.median(ms), "wall_s": wall, "val_loss": val_loss,
            "steps": len(ends), "exit": proc.returncode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="alternating ours/Trainer pairs")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps a run")
    parser.add_argument("--gpu", action="store_true", help="one process on one CUDA GPU, bf16")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.steps <= 2 * WARMUP_STEPS:
        parser.error(f"--steps {args.steps}: give more than {2 * WARMUP_STEPS} (the first "
                     f"{WARMUP_STEPS} are not timed)")
    python = hf_python()
    args.out.mkdir(parents=True, exist_ok=True)
    project = bake(args.out / "baked", "hf_causal_lm")
    data = args.out / "data"
    if not (data / "model" / "config.json").exists():
        data.mkdir(parents=True, exist_ok=True)
        subprocess.run([python, "-c", MAKE_MODEL, str(data)], check=True)
    rows = []
    for pair in range(args.pairs):
        order = ("ours", "trainer") if pair % 2 == 0 else ("trainer", "ours")
        runs = {name: run(name, python, project, data, args.out / name, args.steps, args.gpu)
                for name in order}
        rows.append(runs)
        for name in ("ours", "trainer"):
            r = runs[name]
            print(f"pair {pair + 1} {name:8s} {r['step_ms']:8.1f} ms/step  {r['wall_s']:6.1f} s "
                  f"wall  val_loss {r['val_loss']:.4f}  exit {r['exit']}", flush=True)
    ratios = [r["ours"]["step_ms"] / r["trainer"]["step_ms"] for r in rows]
    losses = [r["ours"]["val_loss"] / r["trainer"]["val_loss"] for r in rows]
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"val_loss ours/Trainer: {statistics.median(losses):.4f}")
    print(f"per-step ours/Trainer: {statistics.median(ratios):.3f} "
          f"(pairs {min(ratios):.3f}-{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
