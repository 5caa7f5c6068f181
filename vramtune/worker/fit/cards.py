"""The cards `vramtune fit` compares against: common NVIDIA cards by name, or any size.

Each built-in card has its **nominal** memory, the size on NVIDIA's datasheet (a "24 GB" card
has 24 GiB of memory chips: NVIDIA counts these sizes in binary units), and its **usable**
memory: the nominal size less `RESERVED_BYTES`, what a training process can never have. That
allowance covers the cuBLAS/cuDNN workspaces (8-32 MiB a handle), kernels loaded past the
context's and the memory the driver keeps back (ECC on GDDR cards, firmware): nvidia-smi shows
every card below its nominal size. The CUDA context itself (300-400 MiB with lazy module
loading, more without: /work/shared/FACTS.md, "CUDA caching allocator and the card") is
`CUDA_CONTEXT_BYTES`, which `fit` counts against the usable memory beside the predicted peak,
so the answer shows it. Both are fixed, deliberately round figures, not measurements of any one
card: a size given instead of a name (``8GiB``, what ``nvidia-smi --query-gpu=memory.free``
says on your machine before the run) is the usable memory as it is, the context still to come
out of it.

Torch-free: the command line parses cards before it imports the predictor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vramtune.worker.device.gpu import parse_size

GIB = 1024**3
MIB = 1024**2
CUDA_CONTEXT_BYTES = 384 * MIB
"""The CUDA context and loaded kernels of a training process with lazy module loading (the top
of the 300-400 MiB FACTS.md gives): outside the caching allocator, so no trace sees it. `fit`
counts it against every card on top of the predicted peak and shows it on its own line."""
RESERVED_BYTES = GIB - CUDA_CONTEXT_BYTES
"""Nominal less usable: the workspaces, the driver's share and room for kernels loaded beyond
the context's (module docstring); with `CUDA_CONTEXT_BYTES`, a round 1 GiB."""


@dataclass(frozen=True)
class Card:
    """A card to fit on: its name, nominal memory and the memory a training run can use."""

    name: str
    nominal_bytes: int
    usable_bytes: int

    @classmethod
    def nominal(cls, name: str, gib: int) -> Card:
        """A datasheet card of `gib` GiB, usable as that less `RESERVED_BYTES`."""
        return cls(name, gib * GIB, gib * GIB - RESERVED_BYTES)


CARDS: dict[str, Card] = {
    card.name: card
    for card in (
        Card.nominal("T4", 16),
        Card.nominal("V100-16GB", 16),
        Card.nominal("V100-32GB", 32),
        Card.nominal("A10", 24),
        Card.nominal("A10G", 24),
        Card.nominal("L4", 24),
        Card.nominal("RTX-3090", 24),
        Card.nominal("RTX-4090", 24),
        Card.nominal("RTX-5090", 32),
        Card.nominal("A40", 48),
        Card.nominal("L40S", 48),
        Card.nominal("RTX-6000-Ada", 48),
        Card.nominal("A100-40GB", 40),
        Card.nominal("A100-80GB", 80),
        Card.nominal("H100", 80),
        Card.nominal("H200", 141),
        Card.nominal("B200", 180),
    )
}
"""The built-in cards by name; `register_card` adds to it."""

_ALIASES = {"A100": "A100-80GB", "V100": "V100-16GB", "3090": "RTX-3090", "4090": "RTX-4090"}


def _folded(name: str) -> str:
    """A card name as compared: case, spaces, dashes and a leading "NVIDIA" ignored."""
    return re.sub(r"[\s_-]+", "", name.upper()).removeprefix("NVIDIA")


def register_card(name: str, usable_bytes: int, nominal_bytes: int | None = None) -> Card:
    """Add (or replace) a named card of `usable_bytes` to the table `card_named` reads."""
    if usable_bytes <= 0:
        raise ValueError(f"card {name!r}: usable memory must be positive, got {usable_bytes}")
    card = Card(name, nominal_bytes or usable_bytes, usable_bytes)
    CARDS[name] = card
    return card


def card_named(text: str) -> Card:
    """The card `text` names (a built-in or registered name, case-insensitive) or a size such
    as ``8GiB`` (a card of that usable memory); ValueError lists the names it knows."""
    wanted = _folded(text)
    for name, card in CARDS.items():
        if _folded(name) == wanted:
            return card
    for alias, name in _ALIASES.items():
        if _folded(alias) == wanted and name in CARDS:
            return CARDS[name]
    try:
        size = parse_size(text)
    except ValueError:
        known = ", ".join(CARDS)
        raise ValueError(
            f"unknown card {text!r}: give a size such as 8GiB or one of {known}"
        ) from None
    return Card(text, size, size)
