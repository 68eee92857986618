"""pytorch-lightning Trainer(strategy="ddp", accelerator="cpu", devices=2) on the same data and model,
with logging, progress bar, checkpointing and model summary off. Started by torchrun like the others
(Lightning detects torchrun and uses its processes). GPU mode: accelerator="gpu", precision="bf16-mixed"."""

import time

import pytorch_lightning as pl
import torch.distributed as dist
import torch.nn.functional as F
from common import StepClock, finish, make_optimizer, parse, setup, write_result
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

args = parse()
data, model, device = setup(args)  # the process group is set up; Lightning reuses it
clock = StepClock(device, cuda_events=True)


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        clock.tick()

    def configure_optimizers(self):
        return make_optimizer(self.parameters())


gpu = device.type == "cuda"
dataset = TensorDataset(*data.tensors)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, seed=0), pin_memory=gpu)
trainer = pl.Trainer(strategy="ddp", accelerator="gpu" if gpu else "cpu", devices=dist.get_world_size(),
                     precision="bf16-mixed" if gpu else "32-true", max_epochs=args.epochs, logger=False,
                     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                     use_distributed_sampler=False)
trainer.fit(Module(), loader)
write_result(clock, args.result, finished_at=time.time())
finish()
