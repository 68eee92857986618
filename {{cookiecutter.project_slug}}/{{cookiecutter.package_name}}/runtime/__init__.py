"""The machinery that keeps runs alive and honest, which a user should never need to open: how
processes meet (rendezvous, environments, network) and join a run (launch), deadlines and signals
(lifeline, and the backstop watchdog process), data-loader workers, PyTorch and NCCL work-arounds,
gradient-compression comm hooks and metric trackers. Nothing is imported here:
`python -m <package>.runtime.network` and the backstop (started by path) must not import torch."""
