"""NCCL settings: fail fast instead of hanging, and leave a record of what every rank was doing:
environment variables PyTorch reads when the process group starts; one you set yourself always wins
(docs/recovery.md, "NCCL settings", says what each does)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

# Start-up and the first step may legitimately take long on GPUs (NCCL's own set-up, cuDNN
# autotuning, torch.compile): they get at least this long; training then gets --timeout-s.
STARTUP_TIMEOUT_S = 600.0


def nccl_env(output_dir: str | Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set before an NCCL process group starts: those the user has not set."""
    dump = str(Path(output_dir).resolve() / "nccl_flight_recorder" / "rank_")
    wanted = {
        # A collective that fails or times out aborts NCCL and ends the process, instead of
        # leaving it blocked forever; 3 skips the clean-up, which can itself hang after an error.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        # The flight recorder: the last collectives of every rank, kept in memory ...
        "TORCH_FR_BUFFER_SIZE": "2000",
        # ... and written to <output-dir>/nccl_flight_recorder/rank_<N> when a collective times out.
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": dump,
    }
    return {name: value for name, value in wanted.items() if name not in environ}


def startup_timeout_s(timeout_s: float, backend: str) -> float:
    """How long start-up and the first step may wait for the other ranks."""
    return max(timeout_s, STARTUP_TIMEOUT_S) if backend == "nccl" else timeout_s


def flight_recorder_hint(output_dir: str | Path) -> str:
    folder = Path(output_dir).resolve() / "nccl_flight_recorder"
    return (f"NCCL's flight recorder wrote each rank's last collectives to {folder} (read them "
            f"with `python -m torch.distributed.flight_recorder.fr_trace {folder} -p rank_`)")
