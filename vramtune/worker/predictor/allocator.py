"""A model of PyTorch's CUDA caching allocator: what a traced allocation sequence reserves.

Replays the tracker's (storage, ±bytes) events through the allocator's rules (c10's
CUDACachingAllocator). With the default settings: requests round up to 512 bytes; requests of
at most 1 MiB come from 2 MiB segments (the small pool), others from the large pool, whose new
segments are 20 MiB below 10 MiB and the request rounded up to 2 MiB above; a free block is
reused best-fit and split when the rest is worth keeping (>= 512 B small, > 1 MiB large); freed
blocks merge with free neighbours; segments are never given back (no empty_cache mid-step).

`PYTORCH_CUDA_ALLOC_CONF` settings (vramtune/worker/device/alloc_conf.py) change the rules:
`roundup_power2_divisions` rounds a request up to the next of N steps between its powers of
two; `max_split_size_mb` keeps blocks of at least that size whole (a smaller request never takes
one, a larger one only when it wastes less than `max_non_split_rounding_mb`, 20 MiB); and
`expandable_segments` gives each pool one segment that grows by mapping pages (2 MiB small,
20 MiB large) when no free block fits, so reserved follows allocated within a page.
Each stream has its own pools, as in the allocator (a block freed on one stream is never
reused by another); `release_cached` is `empty_cache()` (whole free segments given back; with
expandable segments, the whole pages inside free blocks unmapped). Checked against real runs:
tests/worker/test_snapshot_replay.py replays public snapshots (bench/snapshot_replay.py) and
every one, default, expandable and ten-stream alike, gets the same segments to the byte.

Not modelled: `garbage_collection_threshold` (it needs the card's capacity and the blocks'
ages), blocks used on a second stream (`record_stream`), and the retry that frees cached blocks
when cudaMalloc fails near the card's limit (a replay sees its segment frees as a release).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from vramtune.worker.device.alloc_conf import AllocatorSettings

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # largest request served by the small pool
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20
MIN_LARGE_ALLOC = 10 << 20  # requests at least this big get a segment of their own size
ROUND_LARGE = 2 << 20
DEFAULT_SETTINGS = AllocatorSettings()


def round_request(nbytes: int, settings: AllocatorSettings = DEFAULT_SETTINGS) -> int:
    """The allocator's block size for a request of `nbytes`."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    divisions = settings.divisions(nbytes)
    if divisions > 1 and nbytes > MIN_BLOCK * divisions:
        return _next_division(nbytes, divisions)
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def _next_division(nbytes: int, divisions: int) -> int:
    # The interval between the powers of two around `nbytes`, cut into `divisions` equal steps.
    if nbytes & (nbytes - 1) == 0:
        return nbytes
    floor = 1 << (nbytes.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    return -(-nbytes // step) * step


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
    stream: int = 0
    unmapped: int = 0  # expandable segments: bytes of the block's pages given back

    def order(self) -> tuple[int, int, int]:
        """Best-fit order of the free lists: size, then address."""
        return (self.size, self.segment, self.offset)

    @property
    def pool(self) -> tuple[bool, int]:
        """The free list the block returns to: small or large, on its stream."""
        return (self.small, self.stream)


@dataclass
class AllocatorPeaks:
    """The modelled peaks: bytes in allocated blocks and bytes of segments reserved."""

    allocated: int
    reserved: int


@dataclass
class CachingAllocatorModel:
    """Replays allocations and frees; tracks allocated and reserved bytes and their peaks."""

    settings: AllocatorSettings = DEFAULT_SETTINGS
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segment_sizes: list[int] = field(default_factory=list)  # each cudaMalloc / page map, in order
    _free: dict[tuple[bool, int], list[tuple[tuple[int, int, int], _Block]]] = field(
        default_factory=dict
    )
    _live: dict[int, _Block] = field(default_factory=dict)
    _segments: int = 0
    # expandable_segments: the last block of each pool's one segment (its mapped end)
    _tails: dict[tuple[bool, int], _Block] = field(default_factory=dict)

    def malloc(self, key: int, nbytes: int, stream: int = 0) -> None:
        """Allocate `nbytes` for the storage called `key`."""
        size = round_request(nbytes, self.settings)
        small = size <= SMALL_SIZE
        block = self._take_free(size, small, stream)
        if block is None:
            block = (
                self._grow(size, small, stream)
                if self.settings.expandable_segments
                else self._new_segment(size, small, stream)
            )
        if block.unmapped:
            self._remap(block, size)
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

    def seed_segment(
        self, blocks: list[tuple[int | None, int]], small: bool, stream: int = 0
    ) -> None:
        """Add a segment that exists before the replay starts (a warm process's cache).

        `blocks` are (key, size) in address order; key None is a free block. The segment is
        never the growing end of an expandable pool: a recorded run's mapped pages are whole.
        """
        self._segments += 1
        offset = 0
        previous: _Block | None = None
        for key, size in blocks:
            block = _Block(self._segments, offset, size, small, prev=previous, stream=stream)
            if previous is not None:
                previous.next = block
            offset += size
            previous = block
            if key is None:
                self._insert_free(block)
            else:
                block.free = False
                self._live[key] = block
                self.allocated += size
        self.reserved += offset
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def release_cached(self) -> None:
        """`torch.cuda.empty_cache()`: give back every segment that is one free block.

        With expandable segments the allocator instead unmaps every whole page inside a free
        block; the model counts those bytes on the block and maps them again when the block is
        used (by count, not by address: which pages come back first is not modelled).
        """
        if self.settings.expandable_segments:
            for pool in self._free.values():
                for _, block in pool:
                    page = SMALL_SEGMENT if block.small else LARGE_SEGMENT
                    first = -(-block.offset // page) * page
                    last = (block.offset + block.size) // page * page
                    pages = max(0, last - first)
                    if pages > block.unmapped:
                        self.reserved -= pages - block.unmapped
                        block.unmapped = pages
            return
        for pool in self._free.values():
            for _, block in list(pool):
                if block.prev is None and block.next is None:
                    self._remove_free(block)
                    self.reserved -= block.size

    def _remap(self, block: _Block, size: int) -> None:
        # Map back as many of the block's given-back pages as the request needs.
        page = SMALL_SEGMENT if block.small else LARGE_SEGMENT
        mapped = min(block.unmapped, -(-size // page) * page)
        block.unmapped -= mapped
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segment_sizes.append(mapped)

    def _take_free(self, size: int, small: bool, stream: int) -> _Block | None:
        pool = self._free.get((small, stream), [])
        index = bisect.bisect_left(pool, (size, -1, -1), key=lambda entry: entry[0])
        tail = self._tails.get((small, stream))
        if tail is not None and index < len(pool) and pool[index][1] is tail:
            # The growing end of an expandable segment can map more pages, so the allocator
            # counts it as larger than any other block: the next fitting block goes first.
            index += 1
        if index == len(pool):
            return None
        block = pool[index][1]
        limit = self.settings.max_split_size
        if limit is not None:
            # Blocks of at least max_split_size are kept whole for requests as large; a large
            # request takes one only when it wastes less than max_non_split_rounding.
            if size < limit and block.size >= limit:
                return None
            if size >= limit and block.size >= size + self.settings.max_non_split_rounding:
                return None
        return pool.pop(index)[1]

    def _new_segment(self, size: int, small: bool, stream: int) -> _Block:
        total = SMALL_SEGMENT if small else segment_size(size)
        self._segments += 1
        self.reserved += total
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segment_sizes.append(total)
        block = _Block(segment=self._segments, offset=0, size=total, small=small, stream=stream)
        return block

    def _grow(self, size: int, small: bool, stream: int) -> _Block:
        # expandable_segments: map pages at the end of the pool's segment, merging them with a
        # free block already there, until the request fits.
        page = SMALL_SEGMENT if small else LARGE_SEGMENT
        tail = self._tails.get((small, stream))
        have = tail.size if tail is not None and tail.free else 0
        if have >= size:  # the tail fits as it is
            assert tail is not None
            self._remove_free(tail)
            return tail
        mapped = -(-(size - have) // page) * page
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segment_sizes.append(mapped)
        if tail is not None and tail.free:
            self._remove_free(tail)
            tail.size += mapped
            return tail
        if tail is None:
            self._segments += 1
            block = _Block(self._segments, 0, mapped, small, stream=stream)
        else:
            block = _Block(tail.segment, tail.offset + tail.size, mapped, small, prev=tail)
            block.stream = stream
            tail.next = block
        self._tails[(small, stream)] = block
        return block

    def _split(self, block: _Block, size: int) -> None:
        rest = block.size - size
        limit = self.settings.max_split_size
        if block.small or self.settings.expandable_segments:
            worth_keeping = rest >= MIN_BLOCK
        else:
            worth_keeping = rest > SMALL_SIZE and (limit is None or size < limit)
        if not worth_keeping:
            return
        tail = _Block(
            block.segment,
            block.offset + size,
            rest,
            block.small,
            prev=block,
            next=block.next,
            stream=block.stream,
        )
        if block.next is not None:
            block.next.prev = tail
        elif self._tails.get(block.pool) is block:
            self._tails[block.pool] = tail
        block.next = tail
        block.size = size
        tail.unmapped, block.unmapped = block.unmapped, 0
        self._insert_free(tail)

    def _merge(self, block: _Block, neighbour: _Block) -> _Block:
        first, second = (
            (neighbour, block) if neighbour.offset < block.offset else (block, neighbour)
        )
        first.size += second.size
        first.unmapped += second.unmapped
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        elif self._tails.get(second.pool) is second:
            self._tails[second.pool] = first
        first.free = True
        return first

    def _insert_free(self, block: _Block) -> None:
        pool = self._free.setdefault(block.pool, [])
        bisect.insort(pool, (block.order(), block), key=lambda entry: entry[0])

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[block.pool]
        index = bisect.bisect_left(pool, block.order(), key=lambda entry: entry[0])
        while pool[index][1] is not block:
            index += 1
        pool.pop(index)


def replay(
    events: Iterable[tuple[int, int]],
    preallocated: Iterable[int] = (),
    settings: AllocatorSettings = DEFAULT_SETTINGS,
) -> AllocatorPeaks:
    """Peaks of the allocator over `events` ((key, +bytes) malloc, (key, -bytes) free).

    `preallocated` are blocks allocated first and never freed (the cuBLAS workspaces).
    """
    model = CachingAllocatorModel(settings=settings)
    for index, nbytes in enumerate(preallocated):
        if nbytes > 0:
            model.malloc(-1 - index, nbytes)
    for key, nbytes in events:
        if nbytes > 0:
            model.malloc(key, nbytes)
        else:
            model.free(key)
    return AllocatorPeaks(allocated=model.peak_allocated, reserved=model.peak_reserved)
