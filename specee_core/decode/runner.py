"""An engine core stepping on a thread of its own (Serve's replica): submit() from any thread returns a Future of
the request's results; a watchdog tells a health check whether a step stalled or the engine failed for good."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError

import torch

from specee_core.decode.core import EngineCore
from specee_core.decode.request import Request

log = logging.getLogger(__name__)


class Watchdog:
    """What a health check needs of the thread that runs an engine: since when its current step or
    call runs, and whether the engine failed for good."""
    busy_what = "an engine call"

    def __init__(self, stall_timeout_s: float):
        self.stall_timeout_s = stall_timeout_s
        self._busy_since: float | None = None
        self._fatal: str | None = None

    def check(self) -> None:
        """RuntimeError when the engine failed for good or the current step has run past stall_timeout_s."""
        if self._fatal:
            raise RuntimeError(f"engine failed: {self._fatal}")
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > self.stall_timeout_s:
            raise RuntimeError(f"{self.busy_what} has run for over {self.stall_timeout_s:.0f} s")


class Runner(Watchdog):
    """An EngineCore stepping on its own thread whenever it has work. submit() from any thread returns a
    concurrent Future of the request's results (asyncio: `asyncio.wrap_future`)."""
    busy_what = "a decode step"

    def __init__(self, core: EngineCore, stall_timeout_s: float = 600.0):
        super().__init__(stall_timeout_s)
        self.core = core
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specee-core", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Future:
        fut: Future = Future()
        then = request.on_done

        def done(r: Request) -> None:
            try:
                if then is not None:
                    then(r)
            finally:
                try:
                    if r.error is not None:
                        fut.set_exception(r.error)
                    else:
                        fut.set_result(r.results)
                except InvalidStateError:  # cancelled by the caller (asyncio.wrap_future does, with its task)
                    pass

        request.on_done = done
        self.core.submit(request)  # raises here for a request that cannot run
        self._wake.set()
        return fut

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()  # before looking for work: a submit after this sets it again
            while self.core.busy:
                self._busy_since = time.monotonic()
                try:
                    self.core.step()
                except BaseException as e:  # noqa: BLE001 -- a bug or out of memory: fail what is running, go on
                    log.exception("engine core step failed; failing %d requests", len(self.core.active))
                    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
                        self._fatal = repr(e)
                    try:
                        self.core.fail_all(e)
                    except BaseException as again:  # noqa: BLE001 -- nothing left to do: report it in check()
                        self._fatal = f"{e!r}, then {again!r}"
                        raise
                finally:
                    self._busy_since = None

    def check(self) -> None:
        super().check()
        if not self._thread.is_alive():
            raise RuntimeError("the engine core's thread has stopped")
