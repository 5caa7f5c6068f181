"""What the long-running commands (`vramtune worker`, `vramtune ray up`) share: how they are told
to stop, and their count options. Standard library only."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType


def stop_on_signals(log: logging.Logger, doing: str) -> threading.Event:
    """An Event that SIGTERM and SIGINT set; each logs 'signal NAME: `doing`'."""
    stop = threading.Event()

    def handle(signum: int, frame: FrameType | None) -> None:
        log.info("signal %s: %s", signal.Signals(signum).name, doing)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return stop


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from error
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
