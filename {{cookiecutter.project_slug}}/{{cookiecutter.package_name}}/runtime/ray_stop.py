"""Ctrl-C or SIGTERM to the Ray driver (what a scheduler, KubeRay or `timeout` sends) saves, as
under torchrun: `fit` runs in a thread (Ray's own handlers, set from the main thread only, would
end the workers unsaved), the driver's handlers take both signals, and an actor tells the
workers, whose lifeline stops the run at its next log step as that signal would."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from concurrent import futures
from typing import Any

from .backstop import STOP_SAVE_S
from .lifeline import Lifeline


class Stop:
    """The driver's stop signal, for its workers (a Ray actor): `wait` returns its number once
    `set` is called."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.signum = int(signal.SIGINT)

    async def wait(self) -> int:
        await self.event.wait()
        return self.signum

    async def set(self, signum: int) -> None:
        self.signum = signum
        self.event.set()


class RayLifeline(Lifeline):
    """A Ray worker's lifeline. Ray runs `main` in a thread of its worker, where no signal handler
    can be installed: the driver's signal comes as a message instead, told here as that signal."""

    running: RayLifeline | None = None

    def start(self) -> RayLifeline:
        RayLifeline.running = self
        return super().start()

    def stop(self, signum: int) -> bool:
        """Stop as at that signal: save at the next log step. False while starting, where the
        signal would end the process at once (and Ray would start it again)."""
        if self._phase == "starting":
            return False
        self._writer.send(bytes([signum]))
        return True


def stop_when_told(stop: Any) -> None:
    """A worker's thread: waits for the driver's stop signal, then tells the run once it trains
    (or its closed lifeline, once it ended: the worker ends soon after)."""
    import ray

    with contextlib.suppress(Exception):  # the driver gone: no signal to wait for
        signum = ray.get(stop.wait.remote())
        while not (RayLifeline.running and RayLifeline.running.stop(signum)):
            time.sleep(0.2)


def said(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class Signalled(Exception):
    """Ctrl-C or SIGTERM to the driver, raised in its main thread."""

    def __init__(self, signum: int) -> None:
        super().__init__(said(signum))
        self.signum = signum


class Unsaved(BaseException):
    """Stopped without the workers' save: a second signal, or none within STOP_SAVE_S."""

    def __init__(self, signum: int) -> None:
        super().__init__(said(signum))
        self.signum = signum


def fit_in_thread(trainer: Any, stop: Any) -> Any:
    """trainer.fit()'s result, from a thread: Ctrl-C or SIGTERM tells the workers to save and
    stop; a second one, or no save within STOP_SAVE_S, raises Unsaved."""
    done: futures.Future = futures.Future()

    def fit() -> None:  # its result, or what it raised, for the main thread
        try:
            done.set_result(trainer.fit())
        except BaseException as exc:  # noqa: BLE001  (raised again by done.result())
            done.set_exception(exc)

    def signalled(signum: int, frame: Any) -> None:
        raise Signalled(signum)

    # Both replace Ray's (its SIGTERM handler exits at once) and `cmd &`'s ignored SIGINT.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signalled)
    threading.Thread(target=fit, daemon=True).start()
    try:
        return done.result()
    except Signalled as first:
        what = said(first.signum)
        print(f"ray: {what}: the workers save at their next log step and stop (within "
              f"{STOP_SAVE_S:g} s; {what} again stops now, without a save)", flush=True)
        stop.set.remote(first.signum)
        try:
            return done.result(STOP_SAVE_S)
        except (Signalled, futures.TimeoutError):
            raise Unsaved(first.signum) from None
