"""A model of PyTorch's CUDA caching allocator: what a traced allocation sequence reserves.

Replays the tracker's (storage, ±bytes) events through the allocator's rules (c10's
CUDACachingAllocator with the default settings): requests round up to 512 bytes; requests of
at most 1 MiB come from 2 MiB segments (the small pool), others from the large pool, whose new
segments are 20 MiB below 10 MiB and the request rounded up to 2 MiB above; a free block is
reused best-fit and split when the rest is worth keeping (>= 512 B small, > 1 MiB large); freed
blocks merge with free neighbours; segments are never given back (no empty_cache mid-step).

Not modelled: several streams, `expandable_segments`, `max_split_size_mb`, and the retry that
frees cached blocks when cudaMalloc fails near the card's limit.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # largest request served by the small pool
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20
MIN_LARGE_ALLOC = 10 << 20  # requests at least this big get a segment of their own size
ROUND_LARGE = 2 << 20


def round_request(nbytes: int) -> int:
    """The allocator's block size for a request of `nbytes`."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(nbytes: int) -> int:
    """The size of the segment cudaMalloc'ed for a (rounded) request no cached block can serve."""
    if nbytes <= SMALL_SIZE:
        return SMALL_SEGMENT
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    """A piece of a segment: allocated or free, linked to its neighbours."""

    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def order(self) -> tuple[int, int, int]:
        """Best-fit order of the free lists: size, then address."""
        return (self.size, self.segment, self.offset)


@dataclass
class AllocatorPeaks:
    """The modelled peaks: bytes in allocated blocks and bytes of segments reserved."""

    allocated: int
    reserved: int


@dataclass
class CachingAllocatorModel:
    """Replays allocations and frees; tracks allocated and reserved bytes and their peaks."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    _free: dict[bool, list[tuple[tuple[int, int, int], _Block]]] = field(
        default_factory=lambda: {True: [], False: []}
    )
    _live: dict[int, _Block] = field(default_factory=dict)
    _segments: int = 0

    def malloc(self, key: int, nbytes: int) -> None:
        """Allocate `nbytes` for the storage called `key`."""
        size = round_request(nbytes)
        small = size <= SMALL_SIZE
        block = self._take_free(size, small) or self._new_segment(size, small)
        self._split(block, size)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: int) -> None:
        """Free the storage called `key` (unknown keys are ignored)."""
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove_free(neighbour)
                block = self._merge(block, neighbour)
        self._insert_free(block)

    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        index = bisect.bisect_left(pool, (size, -1, -1), key=lambda entry: entry[0])
        if index == len(pool):
            return None
        return pool.pop(index)[1]

    def _new_segment(self, size: int, small: bool) -> _Block:
        total = SMALL_SEGMENT if small else segment_size(size)
        self._segments += 1
        self.reserved += total
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(segment=self._segments, offset=0, size=total, small=small)

    def _split(self, block: _Block, size: int) -> None:
        rest = block.size - size
        worth_keeping = rest >= MIN_BLOCK if block.small else rest > SMALL_SIZE
        if not worth_keeping:
            return
        tail = _Block(
            block.segment, block.offset + size, rest, block.small, prev=block, next=block.next
        )
        if block.next is not None:
            block.next.prev = tail
        block.next = tail
        block.size = size
        self._insert_free(tail)

    def _merge(self, block: _Block, neighbour: _Block) -> _Block:
        first, second = (
            (neighbour, block) if neighbour.offset < block.offset else (block, neighbour)
        )
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        first.free = True
        return first

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.order(), block), key=lambda entry: entry[0])

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[block.small]
        index = bisect.bisect_left(pool, block.order(), key=lambda entry: entry[0])
        while pool[index][1] is not block:
            index += 1
        pool.pop(index)


def replay(events: Iterable[tuple[int, int]], preallocated: Iterable[int] = ()) -> AllocatorPeaks:
    """Peaks of the allocator over `events` ((key, +bytes) malloc, (key, -bytes) free).

    `preallocated` are blocks allocated first and never freed (the cuBLAS workspaces).
    """
    model = CachingAllocatorModel()
    for index, nbytes in enumerate(preallocated):
        if nbytes > 0:
            model.malloc(-1 - index, nbytes)
    for key, nbytes in events:
        if nbytes > 0:
            model.malloc(key, nbytes)
        else:
            model.free(key)
    return AllocatorPeaks(allocated=model.peak_allocated, reserved=model.peak_reserved)
