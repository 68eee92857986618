"""The ddp-tutorial-series style: a per-sample Dataset of (x, y) tuples, default collate, a Trainer
with _run_batch/_run_epoch and an extra next(iter(...)) per epoch to print the batch size. Adapted
only to CPU/gloo (no device ids) and to the same model, loss and optimizer as the others; on a GPU it
moves each batch to the device as the tutorial does, under the GPU mode's bf16 autocast."""

import torch.distributed as dist
import torch.nn.functional as F
from common import StepClock, autocast, finish, make_optimizer, parse, setup, write_result
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class PairDataset(Dataset):
    def __init__(self, x, y):
        self.data = [(x[i], y[i]) for i in range(len(x))]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, loader, optimizer, clock, device):
        self.model = DDP(model, device_ids=[device] if device.type == "cuda" else None)
        self.loader, self.optimizer, self.clock, self.device = loader, optimizer, clock, device

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        with autocast(self.device):
            out = self.model(source)
        loss = F.mse_loss(out.float(), targets)
        loss.backward()
        self.optimizer.step()
        self.clock.tick()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.loader))[0])
        if dist.get_rank() == 0 and epoch == 0:
            print(f"Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.loader)}", flush=True)
        self.loader.sampler.set_epoch(epoch)
        for source, targets in self.loader:
            self._run_batch(source.to(self.device), targets.to(self.device))

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


args = parse()
data, model, device = setup(args)
dataset = PairDataset(*data.tensors)
loader = DataLoader(dataset, batch_size=args.batch_size, pin_memory=False, shuffle=False,
                    sampler=DistributedSampler(dataset))
clock = StepClock(device, cuda_events=True)
Trainer(model, loader, make_optimizer(model.parameters(), device), clock, device).train(args.epochs)
write_result(clock, args.result)
finish()
