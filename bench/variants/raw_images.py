"""The hand-written loop for per-sample data: the classification task's image folder, read and
decoded one image at a time by DataLoader workers (DistributedSampler, default collate), the same
CNN, loss and optimizer as ours. What ours is compared with on the `images` workload."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import StepClock, finish, make_optimizer, parse, write_result
from ddp_project.task import ImageFolder, SmallCNN
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

args = parse()
dist.init_process_group("gloo")
torch.manual_seed(0)
dataset = ImageFolder(args.data, augment=True)
model = SmallCNN(len(dataset.classes), args.hidden_size, args.num_layers)
ddp = DDP(model)
opt = make_optimizer(model.parameters())  # CPU only
sampler = DistributedSampler(dataset, seed=0)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                    persistent_workers=args.num_workers > 0)
clock = StepClock(torch.device("cpu"))
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for images, labels in loader:
        loss = F.cross_entropy(ddp(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        clock.tick()
write_result(clock, args.result)
finish()
