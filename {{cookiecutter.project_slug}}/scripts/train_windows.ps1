# Train on Windows: gloo (NCCL does not exist there), a file rendezvous and mp.spawn.
#   powershell -File scripts\train_windows.ps1 -NProcs 2 --epochs 3
param(
    [int]$NProcs = 2,
    [Parameter(ValueFromRemainingArguments = $true)] [string[]]$TrainArgs
)
$ErrorActionPreference = "Stop"
Set-Location (Join-Path $PSScriptRoot "..")
# Windows builds of PyTorch have no libuv TCPStore.
$env:USE_LIBUV = "0"
python train.py --nprocs $NProcs --backend gloo --init-method file @TrainArgs
exit $LASTEXITCODE
