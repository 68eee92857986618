"""The floor: a minimal DDP loop, batches cut from tensors already on the device by indexing."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import StepClock, autocast, finish, make_optimizer, parse, setup, write_result
from torch.nn.parallel import DistributedDataParallel as DDP

args = parse()
data, model, device = setup(args)
rank, world = dist.get_rank(), dist.get_world_size()
ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
opt = make_optimizer(model.parameters(), device)
x_all, y_all = (t.to(device) for t in data.tensors)
clock = StepClock(device, cuda_events=True)
per_rank = args.dataset_size // world
for epoch in range(args.epochs):
    g = torch.Generator().manual_seed(epoch)
    shard = torch.randperm(args.dataset_size, generator=g)[rank * per_rank:(rank + 1) * per_rank].to(device)
    for start in range(0, per_rank, args.batch_size):
        idx = shard[start:start + args.batch_size]
        with autocast(device):
            out = ddp(x_all[idx])
        loss = F.mse_loss(out.float(), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        clock.tick()
write_result(clock, args.result)
finish()
