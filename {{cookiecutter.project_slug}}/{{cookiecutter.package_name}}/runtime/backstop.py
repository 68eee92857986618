"""The backstop: a small watchdog process beside every training process, for when Python cannot act.

The lifeline (lifeline.py) is a Python thread: a C call that holds the interpreter lock (a FileStore
spinning on a garbage file, a stuck extension) or a main thread that never comes back from C++
silences it, and then neither deadlines nor SIGTERM work. So each training process starts this file
as a plain Python process (`-I -S`, standard library only, a few MB) that:

- gets every stop signal first (the C-level handler writes it to a socket, `signal.set_wakeup_fd`,
  without the lock), passes it back to the lifeline and, for SIGTERM and SIGINT, starts the clock
  that ends the process: STOP_GRACE_S if starting, STOP_SAVE_S if training (to reach its next log
  step and save), half a second after a second such signal. (SLURM's SIGUSR1 only warns.)
- keeps the lifeline's deadline, MARGIN_S later: past it, it prints one `error:` line naming the
  phase, has faulthandler (lock-free too) write the process's stacks to a file, and SIGKILLs it.
- stops a process whose launcher (torchrun's agent, the mp.spawn parent, srun's step daemon) is
  gone, as if by SIGTERM; and ends when the training process does (its command pipe closes)."""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

STOP_GRACE_S = 4.5  # a stop signal ends a starting or waiting process within 5 s
STOP_SAVE_S = 25.0  # a training one may reach its log step and save (launchers allow 30 s)
MARGIN_S = 3.0  # after the lifeline's deadline: the lifeline, when it can run, speaks first
SAME_EVENT_S = 1.0  # signals this close together are one event (the terminal's and torchrun's)
POLL_S = 0.5
STACKS_SIGNAL = getattr(signal, "SIGUSR2", None)
SUPPORTED = STACKS_SIGNAL is not None and sys.platform != "win32"


class Backstop:
    """The training process's side: starts the watchdog and tells it what the process waits for."""

    def __init__(self, rank: int, stacks_path: Path, launcher_pid: int = 0) -> None:
        self.rank, self.stacks_path, self.launcher_pid = rank, stacks_path, launcher_pid
        self.signals: socket.socket | None = None  # the wakeup fd; signals come back on it
        self._commands, self._token, self._stacks_file = -1, -1, None
        self._proc: subprocess.Popen | None = None

    def start(self) -> Backstop | None:
        """Start the watchdog; None where it cannot run (Windows), and the lifeline goes alone."""
        if not SUPPORTED:
            return None
        (commands_r, commands_w), (stacks_r, stacks_w) = os.pipe(), os.pipe()
        token_r, token_w = os.pipe()
        os.write(token_w, b"x")
        os.close(token_w)
        os.set_blocking(token_r, False)
        ours, theirs = socket.socketpair()
        args = [sys.executable, "-I", "-S", str(Path(__file__).resolve()), str(os.getpid()),
                str(self.launcher_pid), str(self.rank), str(commands_r), str(stacks_r),
                str(theirs.fileno()), str(token_r), str(self.stacks_path)]
        try:
            self._proc = subprocess.Popen(
                args, pass_fds=(commands_r, stacks_r, theirs.fileno(), token_r),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except OSError:
            for fd in (commands_r, commands_w, stacks_r, stacks_w, token_r):
                os.close(fd)
            ours.close()
            return None
        finally:
            theirs.close()
        os.close(commands_r)
        os.close(stacks_r)
        self._commands, self._token, self.signals = commands_w, token_r, ours
        self._stacks_file = os.fdopen(stacks_w, "w")
        faulthandler.register(STACKS_SIGNAL, file=self._stacks_file, all_threads=True)
        return self

    def tell(self, *words: object) -> None:
        """One command line: `arm DEADLINE PHASE WHAT`, `disarm`, `phase NAME`, `hint TEXT`."""
        line = " ".join(str(w).replace("\n", " ") for w in words) + "\n"
        with suppress(OSError):
            os.write(self._commands, line.encode())

    def claim_last_word(self) -> bool:
        """True for the first of this process and its watchdog to ask (both may end the process at
        once: a signal can wake a stuck call): it prints the `error:` line, so the user sees one."""
        return _take(self._token)

    def close(self) -> None:
        """The process is done with it: the watchdog ends (its command pipe closes)."""
        if self._proc is None:
            return
        faulthandler.unregister(STACKS_SIGNAL)
        os.close(self._token)
        os.close(self._commands)
        self._stacks_file.close()
        self.signals.close()
        self._proc.wait()
        self._proc = None


def _say(text: str) -> None:
    os.write(2, (text + "\n").encode())


def _take(token: int) -> bool:
    try:
        return os.read(token, 1) == b"x"
    except OSError:  # empty (BlockingIOError): the other side took it
        return False


def _launcher_gone(worker: int, launcher: int) -> bool:
    if launcher <= 0:
        return False
    with suppress(OSError, ValueError, IndexError):  # Linux: is it still the worker's parent?
        stat = Path(f"/proc/{worker}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1]) != launcher
    try:  # no /proc: does it still exist?
        os.kill(launcher, 0)
    except OSError as exc:  # only "no such process" says it is gone
        return isinstance(exc, ProcessLookupError)
    return False


class Watchdog:
    def __init__(self, worker: int, launcher: int, rank: int, commands: int, stacks: int,
                 signals: socket.socket, token: int, stacks_path: Path) -> None:
        self.worker, self.launcher, self.rank = worker, launcher, rank
        self.commands, self.stacks, self.signals, self.token = commands, stacks, signals, token
        self.stacks_path, self.phase, self.hint = stacks_path, "start-up", "nothing was saved"
        self.deadline: tuple[float, str, str] | None = None  # (when, phase, what)
        self.stop: tuple[float, str] | None = None  # (when the first stop signal came, its name)
        self.second: str | None = None  # the name of a second stop signal
        self.kill_at, self._buffer = float("inf"), b""

    def run(self) -> None:
        while True:
            ready, _, _ = select.select([self.commands, self.signals], [], [], POLL_S)
            if self.commands in ready and not self._read_commands():
                return  # the training process ended
            if self.signals in ready:
                for signum in self.signals.recv(64):
                    if signum:
                        self._on_signal(signum)
            self._check_clocks()

    def _read_commands(self) -> bool:
        if not (data := os.read(self.commands, 4096)):
            return False
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            verb, _, rest = line.decode(errors="replace").partition(" ")
            if verb == "arm":
                when, phase, what = rest.split(" ", 2)
                self.deadline = (float(when), phase.replace("_", " "), what)
            elif verb == "disarm":
                self.deadline = None
            elif verb in ("phase", "hint"):
                setattr(self, verb, rest)
        return True

    def _on_signal(self, signum: int) -> None:
        try:
            self.signals.send(bytes([signum]))  # the lifeline thread acts on it when it can run
        except OSError:  # the training process has just ended (its end is closed): nothing to do
            return
        if signum not in (signal.SIGTERM, signal.SIGINT):
            return
        now, name = time.monotonic(), signal.Signals(signum).name
        if self.stop is None:
            self.stop, self.kill_at = (now, name), now + STOP_SAVE_S
        elif now - self.stop[0] > SAME_EVENT_S and self.second is None:
            # The lifeline ends the process at once, with its own line, when it can run.
            self.second, self.kill_at = name, min(self.kill_at, now + 0.5)

    def _check_clocks(self) -> None:
        now = time.monotonic()
        grace = STOP_SAVE_S if self.phase in ("training", "finishing") else STOP_GRACE_S
        if self.stop is not None and (now > self.kill_at or now > self.stop[0] + grace):
            where = (f"waiting for {self.deadline[2]}" if self.deadline
                     else f"in its {self.phase} phase")
            if self.second:
                self._end(f"error: rank {self.rank}: a second {self.second}: stopped at once "
                          f"({where}), without saving; {self.hint}")
            self._end(f"error: rank {self.rank}: stopped by {self.stop[1]}, but the process did "
                      f"not end within {grace + 0.5:g} s ({where}); ended without saving; "
                      f"{self.hint}")
        if self.deadline is not None and now > self.deadline[0]:
            _, phase, what = self.deadline
            self._end(f"error: rank {self.rank}: stuck in {phase} past its deadline (--timeout-s "
                      f"plus {MARGIN_S:g} s), waiting for {what}; ended by the backstop, which "
                      "does not need Python to answer; the stuck threads' stacks are in "
                      f"{self.stacks_path}")
        if self.stop is None and _launcher_gone(self.worker, self.launcher):
            _say(f"error: rank {self.rank}: its launcher (pid {self.launcher}) is gone; stopping "
                 "this process, as if by SIGTERM")
            self._on_signal(signal.SIGTERM)

    def _end(self, line: str) -> None:
        if _take(self.token):
            _say(line)
            self._write_stacks()
        else:  # the lifeline thread is ending the process: give it a moment
            select.select([self.commands], [], [], 2.0)
        with suppress(OSError):
            os.kill(self.worker, signal.SIGKILL)
        sys.exit(0)

    def _write_stacks(self) -> None:
        """faulthandler in the training process writes every thread's stack into our pipe."""
        try:
            os.kill(self.worker, STACKS_SIGNAL)
        except OSError:
            return
        chunks, until = [], time.monotonic() + 1.0
        while time.monotonic() < until:
            ready, _, _ = select.select([self.stacks], [], [], 0.2)
            if ready:
                if not (data := os.read(self.stacks, 65536)):
                    break
                chunks.append(data)
            elif chunks:
                break  # the dump is written in one go: a pause means it is over
        with suppress(OSError):
            self.stacks_path.parent.mkdir(parents=True, exist_ok=True)
            self.stacks_path.write_bytes(b"".join(chunks))


def main(argv: list[str]) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)  # a signal to the group is the training process's
    worker, launcher, rank, commands, stacks, signals, token = (int(a) for a in argv[:7])
    Watchdog(worker, launcher, rank, commands, stacks, socket.socket(fileno=signals), token,
             Path(argv[7])).run()


if __name__ == "__main__":
    main(sys.argv[1:])
