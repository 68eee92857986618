"""transformers.Trainer on what a task=hf_causal_lm project trains: the same model folder, the same
windows (the project's own task.build_datasets, so the same tokenization, packing and held-out
split), the same per-process batch, AdamW learning rate and steps. Run under torchrun; the flags
are the project's (train.py's), plus --result.

The batch gives the model the window's first seq_len tokens and, as `shift_labels`, the next
token of each: the loss the project computes, over as many tokens (labels=input_ids would feed
one more token a window). Rank 0 writes each step's end (a TrainerCallback: the project's
StepClock) and the validation loss of Trainer.evaluate on the project's held-out windows.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from ddp_project import task
from ddp_project.config import parse_args
from ddp_project.meters import StepClock
from transformers import Trainer, TrainerCallback, TrainingArguments

STARTED_AT = time.time()


class Clock(TrainerCallback):
    def __init__(self) -> None:
        self.clock = StepClock(torch.device("cpu"))

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.tick()


def collate(windows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    batch = torch.stack(windows)
    inputs = batch[:, :-1].contiguous()
    return {"input_ids": inputs, "labels": inputs, "shift_labels": batch[:, 1:].contiguous()}


def main() -> None:
    argv = sys.argv[1:]
    result = argv.pop(argv.index("--result") + 1)
    argv.remove("--result")
    cfg = parse_args(argv, task.Settings, warn=False)
    train, val = task.build_datasets(cfg)
    model = task.build_model(cfg)
    args = TrainingArguments(
        output_dir=os.path.join(cfg.output_dir, "trainer"), per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.batch_size, max_steps=cfg.max_steps,
        learning_rate=cfg.lr, weight_decay=cfg.weight_decay, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=0.0, seed=cfg.seed, use_cpu=not torch.cuda.is_available(),
        bf16=cfg.precision == "bf16", save_strategy="no", eval_strategy="no", report_to="none",
        disable_tqdm=True, logging_strategy="no", dataloader_drop_last=True)
    clock = Clock()
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                      data_collator=collate, callbacks=[clock])
    trainer.train()
    ends = clock.clock.report(STARTED_AT)
    val_loss = trainer.evaluate()["eval_loss"] if val is not None else None
    if int(os.environ.get("RANK", "0")) == 0:
        with open(result, "w") as f:
            json.dump({**ends, "val_loss": val_loss}, f)


if __name__ == "__main__":
    main()
