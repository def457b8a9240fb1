"""SIGHUP and SIGUSR1 during the start-up of `serve` and `picker`.

SIGHUP asks `serve` to re-read its config and SIGUSR1 to reopen its decision log, but the default
action of both ends the process, and the event loop's handlers exist only once serve listens
(about a second after exec). `main` installs `EarlyReload` first thing for `serve` and `picker` (this module
imports nothing heavy, so that is within tens of milliseconds of exec): a SIGHUP until the
loop's handler takes over is remembered, and serve re-reads the config once it can; a SIGUSR1
is ignored (the log is opened afresh at start anyway).
"""

from __future__ import annotations

import signal
from types import FrameType


class EarlyReload:
    def __init__(self) -> None:
        self.pending = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.pending = True

    @classmethod
    def install(cls) -> EarlyReload:
        """The SIGHUP handler in place if it is one of these, else a new one, installed."""
        current = signal.getsignal(signal.SIGHUP)
        if isinstance(current, cls):
            return current
        handler = cls()
        signal.signal(signal.SIGHUP, handler)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        return handler
