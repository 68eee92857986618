"""The language-model floor, written the way nanoGPT's train.py is: the task's own transformer
compiled and then wrapped in DDP, bf16 autocast on a GPU, the fused AdamW, and each step's batch
cut from random windows of a token tensor in host memory, pinned, and copied without blocking
(nanoGPT's get_batch). Levers for bench/levers.py: --loss fp32-logits (the loss outside the model,
on a float32 copy of the logits), --activation-checkpointing, --sdpa (one attention backend)."""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import StepClock, finish, make_optimizer, write_result
from ddp_project.config import parse_args
from ddp_project.parallel import checkpoint_blocks
from ddp_project.task import Settings, build_model
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
for flag in ("--dataset-size", "--batch-size", "--epochs", "--hidden-size", "--num-layers",
             "--num-heads", "--seq-len", "--vocab-size"):
    p.add_argument(flag, type=int, required=True)
p.add_argument("--tie-embeddings", action="store_true")
p.add_argument("--compile", action="store_true")
p.add_argument("--activation-checkpointing", action="store_true")
p.add_argument("--loss", choices=["model", "fp32-logits"], default="model")
p.add_argument("--sdpa", choices=["auto", "flash", "cudnn", "efficient", "math"], default="auto")
p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
p.add_argument("--result", required=True)
args = p.parse_args()

local = int(os.environ.get("LOCAL_RANK", 0))
device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
else:
    dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(1337 + rank)

# The same model as ours: built by the task from the same settings.
cfg = parse_args([f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                  if k in ("hidden_size", "num_layers", "num_heads", "seq_len", "vocab_size")]
                 + (["--tie-embeddings"] if args.tie_embeddings else []), Settings)
model = build_model(cfg).to(device)
if args.activation_checkpointing:
    checkpoint_blocks(list(model.blocks), compiled=args.compile)
optimizer = make_optimizer(model.parameters(), device)
if args.compile:
    model = torch.compile(model)
model = DDP(model, device_ids=[local] if device.type == "cuda" else None)
autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
            else contextlib.nullcontext())
backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def attention() -> contextlib.AbstractContextManager:
    return sdpa_kernel(backends[args.sdpa]) if args.sdpa != "auto" else contextlib.nullcontext()


T = args.seq_len
tokens = torch.randint(256, (args.dataset_size * T + 1,), dtype=torch.long)  # the "train.bin"


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(tokens) - T - 1, (args.batch_size,))
    x = torch.stack([tokens[i:i + T] for i in ix])
    y = torch.stack([tokens[i + 1:i + 1 + T] for i in ix])
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


clock = StepClock(device, cuda_events=True)
steps = args.epochs * (args.dataset_size // world // args.batch_size)
x, y = get_batch()
for _ in range(steps):
    with autocast, attention():
        if args.loss == "model":  # as the task computes it: inside the (compiled) model
            loss = model(x, y).mean()
        else:
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    x, y = get_batch()  # the next batch's copy runs while the GPU computes this step
    with attention():
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    clock.tick()
write_result(clock, args.result, peak_mem_mb=torch.cuda.max_memory_allocated() / 2**20
             if device.type == "cuda" else None)
finish()
