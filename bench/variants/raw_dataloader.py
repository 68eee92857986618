"""The same loop fed by DataLoader + DistributedSampler with per-sample indexing and default collate."""

import torch.nn.functional as F
from common import StepClock, autocast, finish, make_optimizer, parse, setup, write_result
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

args = parse()
data, model, device = setup(args)
ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
opt = make_optimizer(model.parameters(), device)
dataset = TensorDataset(*data.tensors)
sampler = DistributedSampler(dataset, seed=0)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, pin_memory=device.type == "cuda")
clock = StepClock(device, cuda_events=True)
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device):
            out = ddp(x)
        loss = F.mse_loss(out.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        clock.tick()
write_result(clock, args.result)
finish()
