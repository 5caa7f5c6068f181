"""Third-party noise the command line drops: lines every `vramtune` call would print that say
nothing about what the user asked (issue 43).

torchao, imported by a task file or by transformers, logs "Failed to load ..." for each compiled
kernel that does not match this machine (CUDA kernels on a CPU-only install: nothing vramtune
uses), and its import makes torch's pytree log a deprecation meant for torchao's developers.
Only those records are dropped, by their loggers and words: every other warning still shows.
"""

from __future__ import annotations

import logging
import warnings

NOISE: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torch.utils._pytree": ("register_constant() on Enum subclasses is deprecated",),
}
"""Per logger, the start (or a phrase) of the records dropped."""


class _DropNoise(logging.Filter):
    """Drops the records of one logger that read as one of `phrases`."""

    def __init__(self, phrases: tuple[str, ...]) -> None:
        super().__init__()
        self.phrases = phrases

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(phrase in message for phrase in self.phrases)


def quiet_third_party() -> None:
    """Install the filters (idempotent: a logger keeps one of each) before anything imports
    torch or torchao."""
    for name, phrases in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(phrases))
    # torch's own deprecations of APIs that libraries (not the user's code) call at import.
    warnings.filterwarnings(
        "ignore", message=r".*_register_pytree_node is deprecated", category=FutureWarning
    )
