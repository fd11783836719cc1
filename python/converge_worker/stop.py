"""SIGTERM as a flag: the agent's stop protocol (SIGTERM to the worker's process group,
then SIGKILL after its ``--stop-grace``, 10 s by default). The training loop checks the
flag between steps, writes its checkpoint and exits."""

import signal
import threading
from typing import Callable, Dict, Iterable, Optional

__all__ = ["EXIT_STOPPED", "StopRequest", "install_stop_handler"]

#: The exit code after a stop (128 + SIGTERM, like converge-trainer). The agent forgets a
#: worker it stopped whatever its code, but exit 0 of rank 0 otherwise completes the job:
#: after a SIGTERM from anyone else (a person, a script), 0 would end the job as finished,
#: while this code restarts it from its checkpoint.
EXIT_STOPPED = 128 + int(signal.SIGTERM)


class StopRequest:
    """Set once a stop signal arrives. ``bool(stop)`` is :attr:`requested`."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal: Optional[int] = None
        self._previous: Dict[int, object] = {}
        self._callback: Optional[Callable[[int], None]] = None

    @property
    def requested(self) -> bool:
        """Whether a stop signal has arrived."""
        return self._event.is_set()

    def __bool__(self) -> bool:
        return self.requested

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Sleeps until a stop arrives or ``timeout`` seconds pass; returns :attr:`requested`.
        Use it instead of ``time.sleep`` to stop promptly."""
        return self._event.wait(timeout)

    def request(self, signum: int = int(signal.SIGTERM)) -> None:
        """Marks the stop as requested (what the handler does; also for tests)."""
        first = not self._event.is_set()
        if first:
            self.signal = signum
            self._event.set()
        if first and self._callback is not None:
            self._callback(signum)

    def _handle(self, signum: int, frame: object) -> None:
        self.request(signum)

    def restore(self) -> None:
        """Puts back the handlers that were there before :func:`install_stop_handler`."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()


def install_stop_handler(
    callback: Optional[Callable[[int], None]] = None,
    signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT),
) -> StopRequest:
    """Installs handlers for ``signals`` (SIGTERM and SIGINT) that set the returned
    :class:`StopRequest`; ``callback(signum)`` runs on the first signal, in the main
    thread between two Python instructions (keep it short: set state, do not checkpoint
    there). Must be called from the main thread (Python's rule for signal handlers).
    Repeated signals are ignored once the stop is requested."""
    stop = StopRequest()
    stop._callback = callback
    for signum in signals:
        stop._previous[int(signum)] = signal.signal(signum, stop._handle)
    return stop
