"""`PYTORCH_CUDA_ALLOC_CONF`: the caching allocator's settings, parsed into a typed object.

The keys and their forms are PyTorch's documented ones (docs "CUDA memory management",
c10/cuda/CUDAAllocatorConfig): `key:value` pairs separated by commas, except the bracketed list
form of `roundup_power2_divisions` (`[256:1,512:2,>:8]`), whose commas belong to the list.
A bad key or value is an error naming the key, so a worker refuses at start what PyTorch
itself would refuse at its first allocation. The `pinned_*` keys (host memory) and
`graph_capture_record_stream_reuse` (CUDA graphs) configure what the predictor does not model;
they are checked for form only and otherwise ignored. The limits follow PyTorch's
c10/core/AllocatorConfig.cpp (the shared allocator config of recent releases).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

MiB = 1 << 20
# roundup_power2_divisions has one entry per power-of-two interval of the request size,
# starting at 1 MiB ([0, 2 MiB), [2, 4 MiB), ...); the last covers everything above 16 GiB.
ROUNDUP_INTERVALS = 16
LARGE_BUFFER = 20 * MiB  # PyTorch's kLargeBuffer, the default max_non_split_rounding_mb

_PINNED = (
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
)


# keys checked for form only: what they configure (host memory, graph capture) is not modelled
_IGNORED = (*_PINNED, "graph_capture_record_stream_reuse")
# the keys whose field names drop the unit
_FIELDS = {
    "max_split_size_mb": "max_split_size",
    "max_non_split_rounding_mb": "max_non_split_rounding",
}


class AllocConfError(ValueError):
    """`PYTORCH_CUDA_ALLOC_CONF` holds a key or value PyTorch would refuse."""


@dataclass(frozen=True)
class AllocatorSettings:
    """The allocator settings the model follows; the defaults are PyTorch's."""

    expandable_segments: bool = False
    max_split_size: int | None = None  # bytes; None: every block may be split
    max_non_split_rounding: int = LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = field(default=(0,) * ROUNDUP_INTERVALS)
    garbage_collection_threshold: float = 0.0
    release_lock_on_cudamalloc: bool = False

    @property
    def is_default(self) -> bool:
        """True when every setting the model reads is PyTorch's default."""
        return self == AllocatorSettings()

    def divisions(self, nbytes: int) -> int:
        """The roundup_power2_divisions entry for a request of `nbytes`."""
        index = max(0, nbytes.bit_length() - 1 - 20)  # log2(size) - log2(1 MiB)
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (the test data's `settings`)."""
        return {
            "expandable_segments": self.expandable_segments,
            "max_split_size": self.max_split_size,
            "max_non_split_rounding": self.max_non_split_rounding,
            "roundup_power2_divisions": list(self.roundup_power2_divisions),
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "release_lock_on_cudamalloc": self.release_lock_on_cudamalloc,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AllocatorSettings:
        """The inverse of `to_dict`."""
        return cls(
            expandable_segments=bool(data["expandable_segments"]),
            max_split_size=data["max_split_size"],
            max_non_split_rounding=int(data["max_non_split_rounding"]),
            roundup_power2_divisions=tuple(int(v) for v in data["roundup_power2_divisions"]),
            garbage_collection_threshold=float(data["garbage_collection_threshold"]),
            release_lock_on_cudamalloc=bool(data["release_lock_on_cudamalloc"]),
        )


def from_environ(environ: dict[str, str] | None = None) -> AllocatorSettings:
    """The settings of `PYTORCH_CUDA_ALLOC_CONF` in `environ` (the process's by default).

    PyTorch reads `PYTORCH_ALLOC_CONF` first and falls back to the CUDA-specific name.
    """
    env = os.environ if environ is None else environ
    return parse(env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or "")


def raw_from_environ(environ: dict[str, str] | None = None) -> str | None:
    """The text the allocator reads, or None when neither variable is set."""
    env = os.environ if environ is None else environ
    return env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or None


def parse(text: str) -> AllocatorSettings:
    """Settings from the text of `PYTORCH_CUDA_ALLOC_CONF`; AllocConfError names a bad key."""
    values: dict[str, Any] = {}
    for key, value in _pairs(text):
        if key in values:
            raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} is given twice")
        values[key] = _value(key, value)
    fields = {_FIELDS.get(key, key): v for key, v in values.items() if key not in _IGNORED}
    return AllocatorSettings(**fields)


def _pairs(text: str) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    rest = text.strip()
    while rest:
        key, colon, rest = rest.partition(":")
        key = key.strip()
        if not colon or not key:
            raise AllocConfError(
                f"PYTORCH_CUDA_ALLOC_CONF: expected key:value, got {(key or rest)!r}"
            )
        rest = rest.lstrip()
        if rest.startswith("["):
            value, bracket, rest = rest.partition("]")
            if not bracket:
                raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key}: no closing ']'")
            value += "]"
            rest = rest.lstrip()
            if rest and not rest.startswith(","):
                raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key}: text after ']'")
            rest = rest[1:]
        else:
            value, _, rest = rest.partition(",")
        pairs.append((key, value.strip()))
        rest = rest.strip()
    return pairs


def _value(key: str, value: str) -> Any:
    if key in ("expandable_segments", "release_lock_on_cudamalloc"):
        return _bool(key, value)
    if key == "graph_capture_record_stream_reuse":  # CUDA graphs only: checked, not modelled
        _bool(key, value)
        return value
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        mb = _int(key, value)
        # PyTorch's floor for both is a large segment's 20 MiB (kLargeBuffer); releases before
        # the shared AcceleratorAllocatorConfig wanted max_split_size_mb above it.
        if mb * MiB < LARGE_BUFFER:
            raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be >= 20, got {mb}")
        return mb * MiB
    if key == "roundup_power2_divisions":
        return _divisions(key, value)
    if key == "garbage_collection_threshold":
        try:
            threshold = float(value)
        except ValueError:
            raise AllocConfError(
                f"PYTORCH_CUDA_ALLOC_CONF: {key} must be a number, got {value!r}"
            ) from None
        if not 0.0 < threshold < 1.0:
            raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be in (0, 1), got {value}")
        return threshold
    if key in _PINNED:
        if not value:
            raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} has no value")
        return value
    raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: unknown key {key!r}")


def _bool(key: str, value: str) -> bool:
    if value not in ("True", "False"):
        raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be True or False, got {value!r}")
    return value == "True"


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise AllocConfError(
            f"PYTORCH_CUDA_ALLOC_CONF: {key} must be an integer, got {value!r}"
        ) from None


def _power_of_two(key: str, divisions: int) -> int:
    # 0 turns rounding off for its interval; otherwise PyTorch takes only powers of two.
    if divisions != 0 and divisions & (divisions - 1):
        raise AllocConfError(
            f"PYTORCH_CUDA_ALLOC_CONF: {key}: divisions must be a power of two, got {divisions}"
        )
    return divisions


def _divisions(key: str, value: str) -> tuple[int, ...]:
    if not value.startswith("["):
        divisions = _int(key, value)
        if divisions < 1:  # the single-number form takes powers of two only, not 0
            raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be a power of two")
        return (_power_of_two(key, divisions),) * ROUNDUP_INTERVALS
    table = [0] * ROUNDUP_INTERVALS
    last = -1
    entries = [entry.strip() for entry in value[1:-1].split(",") if entry.strip()]
    if not entries:
        raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key}: empty list")
    for entry in entries:
        size, colon, count = entry.partition(":")
        if not colon:
            raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key}: expected size:divisions")
        divisions = _power_of_two(key, _int(key, count))
        if size.strip() == ">":
            # every interval above the last one named
            table[last + 1 :] = [divisions] * (ROUNDUP_INTERVALS - last - 1)
            continue
        mb = _int(key, size)
        if mb <= 0 or mb & (mb - 1):
            raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key}: {mb} is not a power of two")
        # sizes past the last interval share it, as PyTorch clamps them
        index = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if last < 0:
            # the first entry also covers the smaller sizes
            table[:index] = [divisions] * index
        table[index] = divisions
        last = index
    return tuple(table)
