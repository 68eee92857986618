"""What ends a training process that would otherwise hang or die without a word.

The main thread waits inside PyTorch's C++ code (store, rendezvous, collectives), out of reach of
Python's signal handlers and of timeouts of its own. One watcher thread per process does two jobs:

- waits: `with lifeline.waiting("the other ranks to join", hint):` arms a deadline of --timeout-s
  plus a small margin (so PyTorch's own timeout, if any, speaks first). A block not finished by then
  ends the process with one `error:` line: what this rank waited for, and what to do.
- stop signals (SIGTERM from torchrun, SLURM or Kubernetes, SLURM's SIGUSR1, Ctrl-C): during
  start-up there is nothing to save, so the process ends at once, saying so; in training the loop
  stops at its next log step, where the ranks agree, save and exit. A second Ctrl-C ends it at once.

The thread needs the interpreter lock: when a C call holds it, the backstop (backstop.py) ends the
process instead. torch's C++ messages go to a log file (`keep_torch_messages_in`)."""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from .backstop import MARGIN_S, SAME_EVENT_S, Backstop

_terminal_fd = 2  # where this process's own lines go (see keep_torch_messages_in)
STOP_SIGNALS = [getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, n)]
ENDING = (signal.SIGTERM, signal.SIGINT)  # a second one ends it at once (SIGUSR1 only warns)


def keep_torch_messages_in(path: Path) -> None:
    """torch's C++ messages on stderr go to `path` (an unreachable store retries with 30 lines of
    stack frames each time); sys.stderr keeps the terminal. Not if TORCH_CPP_LOG_LEVEL is set."""
    global _terminal_fd
    if "TORCH_CPP_LOG_LEVEL" in os.environ or _terminal_fd != 2:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return  # an output dir that cannot be written is reported by what writes there
    sys.stderr.flush()
    terminal = os.dup(2)
    os.dup2(log, 2)  # file descriptor 2: where C++ code writes
    os.close(log)
    sys.stderr = open(terminal, "w", buffering=1, encoding=sys.stderr.encoding,
                      errors="backslashreplace")
    _terminal_fd = terminal


class Lifeline:
    def __init__(self, rank: int, timeout_s: float, output_dir: str | Path = ".",
                 launcher_pid: int = 0) -> None:
        """launcher_pid: the process whose end ends this one (0: none, e.g. a plain `python`)."""
        self.rank, self.timeout_s = rank, timeout_s
        self._backstop = Backstop(rank, Path(output_dir) / f"stacks-rank{rank}.txt", launcher_pid)
        self._phase = "starting"  # then "training", then "finishing"
        self._hint = "nothing to save"
        self.stop_signal: int | None = None
        self.cleanups: list[Callable[[], None]] = []  # run before the process is ended here
        self._first_signal_at = 0.0
        self._wait: tuple[float, str, str, float] | None = None  # deadline, what, hint, timeout
        self._reader, self._writer = socket.socketpair()
        self._handlers: dict[int, object] = {}
        self._old_wakeup_fd = -1
        self._thread = threading.Thread(target=self._watch, name="lifeline", daemon=True)

    def tell(self, what: str, value: str) -> None:
        """`phase` ("training", then "finishing") or `hint` (what a resume would continue from):
        kept here and told the backstop, which says them where it must end the process."""
        setattr(self, f"_{what}", value)
        if self._backstop:
            self._backstop.tell(what, value)

    def start(self) -> Lifeline:
        """Install the signal handlers (main thread only), start the backstop and watching."""
        self._writer.setblocking(False)
        self._backstop = self._backstop.start()
        # Signals go to the backstop first (no interpreter lock needed), which passes them back.
        signals = self._backstop.signals if self._backstop else self._writer
        signals.setblocking(False)
        if threading.current_thread() is threading.main_thread():  # else a launcher's thread,
            for signum in STOP_SIGNALS:  # which owns the process's signals
                # A Python-level handler must exist for the C-level one to write to the wakeup
                # fd; it does nothing itself (no KeyboardInterrupt traceback on Ctrl-C).
                self._handlers[signum] = signal.signal(signum, lambda *_: None)
            self._old_wakeup_fd = signal.set_wakeup_fd(signals.fileno(), warn_on_full_buffer=False)
        self._thread.start()
        return self

    def close(self) -> None:
        """Give the signals back (tests run training in-process) and stop watching."""
        if self._handlers:
            signal.set_wakeup_fd(self._old_wakeup_fd)
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._phase = "closed"
        self._writer.send(b"\0")  # wakes the thread, which then exits
        self._thread.join()
        if self._backstop:
            self._backstop.close()
            self._backstop = None

    @contextmanager
    def waiting(self, what: str, hint: str, timeout_s: float | None = None,
                phase: str = "a collective") -> Iterator[None]:
        """Arm a deadline of --timeout-s (plus a margin) for the block. `phase` names the kind of
        wait (rendezvous, store, collective, checkpoint I/O, error reporting) for the backstop."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s + 2.0 + 0.1 * timeout_s
        self._wait = (deadline, what, hint, timeout_s)
        with suppress(BlockingIOError):  # wakes the watcher thread
            self._writer.send(b"\0")
        if self._backstop:
            self._backstop.tell("arm", deadline + MARGIN_S, phase.replace(" ", "_"), what)
        try:
            yield
        finally:
            self._wait = None
            if self._backstop:
                self._backstop.tell("disarm")

    def _watch(self) -> None:
        sources = [self._reader] + ([self._backstop.signals] if self._backstop else [])
        while self._phase != "closed":
            wait = self._wait
            timeout = None if wait is None else max(0.0, wait[0] - time.monotonic())
            for source in select.select(sources, [], [], timeout)[0]:
                for signum in source.recv(64):
                    if signum and self._phase != "closed":
                        self._on_signal(signum)
            wait = self._wait
            if wait is not None and wait[0] <= time.monotonic():
                _, what, hint, timeout_s = wait
                self._end(f"error: rank {self.rank}: waited {timeout_s:g} s (--timeout-s) for "
                          f"{what}; {hint}", 1)

    def _on_signal(self, signum: int) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        if self._phase == "starting":
            line = (f"stopped by {name} during start-up, before the first training step: "
                    "nothing to save, nothing lost")
            if "SLURM_JOB_ID" in os.environ:  # a requeued job would start over, again and again
                line += ("; if this was the time-limit signal, the job is requeued without "
                         "progress: lengthen --time or shorten the lead of #SBATCH --signal")
            self._end(line, 128 + signum)
        if self._phase != "training":
            return
        if self.stop_signal is None:
            self.stop_signal, self._first_signal_at = signum, now
        elif (signum in ENDING and self.stop_signal in ENDING
              and now - self._first_signal_at > SAME_EVENT_S):
            what = "Ctrl-C" if signum == signal.SIGINT else name
            self._end(f"second {what}: stopping now without saving; {self._hint}", 128 + signum)

    def _end(self, line: str, code: int) -> None:
        if not self._backstop or self._backstop.claim_last_word():
            os.write(_terminal_fd, (line.rstrip("\n") + "\n").encode())
        for cleanup in self.cleanups:
            with suppress(Exception):
                cleanup()
        os._exit(code)
