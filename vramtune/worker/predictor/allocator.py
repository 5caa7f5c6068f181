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

Near the card's limit (given `capacity`, what cudaMalloc can give; `allowed`, the memory fraction
set): c10's malloc runs `garbage_collect_cached_blocks` before a cudaMalloc when a memory
fraction is set and `garbage_collection_threshold` is: above threshold x the allowed memory,
whole free large blocks at least as old as the average (age: the large pool's free-block
searches since the block was freed, c10's `gc_count`) go back, pass after pass, until the
reserve is under the threshold. A cudaMalloc that would not fit is retried after
`release_available_cached_blocks` (with `max_split_size`: one whole block as large as the
request, else the largest oversize ones) and then after `release_cached_blocks` (every whole
free segment; with expandable segments, the free pages); only then is it an OOM, counted in
`ooms`. The two public runs that freed their cache mid-run were such retries, and replayed
with the card's capacity instead of their recorded releases they get the same segments.

Not modelled: blocks used on a second stream (`record_stream`), CUDA graphs' private pools,
and the free-memory callbacks c10 calls before any of this.
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
    gc_base: int = 0  # its pool's free-block searches when it last entered the free list

    @property
    def whole(self) -> bool:
        """The block is its whole segment (c10's `!is_split()`): it can be given back."""
        return self.prev is None and self.next is None

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
    """Replays allocations and frees; tracks allocated and reserved bytes and their peaks.

    `capacity` is what cudaMalloc can give the allocator: the card's memory less what the CUDA
    context and other processes hold. `allowed` is `set_per_process_memory_fraction`'s limit
    (the fraction of the card's total, c10's `allowed_memory_maximum`); only with it does
    `garbage_collection_threshold` act. None: no limit. An allocation that fits neither even
    after the allocator gave back its cache would raise OutOfMemoryError: it is counted in
    `ooms` and made anyway, so the peaks then exceed the limit.
    """

    settings: AllocatorSettings = DEFAULT_SETTINGS
    capacity: int | None = None
    allowed: int | None = None
    ooms: int = 0
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
    # free-block searches per pool (small, large; all streams share one): the blocks' age clock
    _searches: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})

    def malloc(self, key: int, nbytes: int, stream: int = 0) -> None:
        """Allocate `nbytes` for the storage called `key`."""
        size = round_request(nbytes, self.settings)
        small = size <= SMALL_SIZE
        self._searches[small] += 1  # get_free_block counts its calls on the pool
        if self.settings.expandable_segments and self._limit() is not None:
            self._make_room_expandable(size, small, stream)
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
                if block.whole:
                    self._release(block)

    def _release(self, block: _Block) -> None:
        # c10's release_block: a free block that is its whole segment goes back to CUDA.
        self._remove_free(block)
        self.reserved -= block.size

    def _limit(self) -> int | None:
        limits = [limit for limit in (self.capacity, self.allowed) if limit is not None]
        return min(limits) if limits else None

    def _fits(self, nbytes: int) -> bool:
        limit = self._limit()
        return limit is None or self.reserved + nbytes <= limit

    def _make_room(self, size: int, small: bool, stream: int, total: int) -> None:
        """Before cudaMalloc'ing `total` bytes: garbage collection, then the retries.

        c10's malloc: garbage_collect_cached_blocks when a memory fraction is set; then
        alloc_block, and where it fails, release_available_cached_blocks and alloc_block again,
        then release_cached_blocks (every whole free segment) and alloc_block once more.
        """
        self._collect_garbage()
        if self._fits(total):
            return
        if self._release_available(size, small, stream) and self._fits(total):
            return
        self.release_cached()
        if not self._fits(total):
            self.ooms += 1

    def _collect_garbage(self) -> None:
        """c10's garbage_collect_cached_blocks: above `threshold` x the allowed memory, give
        back whole free large blocks at least as old as the average (in free-block searches of
        the large pool since the block was freed), pass after pass, until the reserve is back
        under the threshold. The allocator runs it only with a memory fraction set."""
        threshold = self.settings.garbage_collection_threshold
        if self.allowed is None or threshold <= 0.0 or self.settings.expandable_segments:
            return
        gc_threshold = int(threshold * self.allowed)
        if self.reserved <= gc_threshold:
            return
        target = self.reserved - gc_threshold
        clock = self._searches[False]
        candidates = [
            block
            for (small, _), pool in self._free.items()
            if not small
            for _, block in pool
            if block.whole
        ]
        total_age = sum(clock - block.gc_base for block in candidates)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and candidates:
            average = total_age / len(candidates)  # fixed for the pass, as in c10
            freed = False
            for block in list(candidates):
                age = clock - block.gc_base
                if age >= average:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    candidates.remove(block)
                    self._release(block)

    def _release_available(self, size: int, small: bool, stream: int) -> bool:
        """c10's release_available_cached_blocks: with max_split_size set, give back one whole
        block at least as large as the request (and the limit), else the largest blocks above
        the limit until as many bytes are back; False when that is not enough."""
        limit = self.settings.max_split_size
        if limit is None or self.settings.expandable_segments:
            return False
        key = max(size, limit)
        pool = self._free.get((small, stream), [])
        index = bisect.bisect_left(pool, (key, -1, -1), key=lambda entry: entry[0])
        if index < len(pool):
            block = pool[index][1]
            if block.whole:
                self._release(block)
            return True
        released = 0
        for _, block in reversed(pool[:index]):
            if released >= key or block.size < limit:
                break
            if block.whole:
                self._release(block)
                released += block.size
        return released >= key

    def _make_room_expandable(self, size: int, small: bool, stream: int) -> None:
        # With expandable segments the retry unmaps the free pages (release_cached_blocks)
        # and maps the request's pages again.
        if not self._fits(self._pages_needed(size, small, stream)):
            self.release_cached()
            if not self._fits(self._pages_needed(size, small, stream)):
                self.ooms += 1

    def _pages_needed(self, size: int, small: bool, stream: int) -> int:
        # The bytes an expandable pool maps to serve the request (see _grow and _remap).
        page = SMALL_SEGMENT if small else LARGE_SEGMENT
        wanted = -(-size // page) * page
        index = self._find_free(size, small, stream)
        if index is not None:
            return min(self._free[(small, stream)][index][1].unmapped, wanted)
        tail = self._tails.get((small, stream))
        if tail is None or not tail.free:
            return -(-size // page) * page
        grown = -(-max(0, size - tail.size) // page) * page
        return grown + min(tail.unmapped, wanted)

    def _remap(self, block: _Block, size: int) -> None:
        # Map back as many of the block's given-back pages as the request needs.
        page = SMALL_SEGMENT if block.small else LARGE_SEGMENT
        mapped = min(block.unmapped, -(-size // page) * page)
        block.unmapped -= mapped
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segment_sizes.append(mapped)

    def _take_free(self, size: int, small: bool, stream: int) -> _Block | None:
        index = self._find_free(size, small, stream)
        return None if index is None else self._free[(small, stream)].pop(index)[1]

    def _find_free(self, size: int, small: bool, stream: int) -> int | None:
        # c10's get_free_block: the index of the best-fit free block, or None.
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
        return index

    def _new_segment(self, size: int, small: bool, stream: int) -> _Block:
        total = SMALL_SEGMENT if small else segment_size(size)
        self._make_room(size, small, stream, total)
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
        block.gc_base = self._searches[block.small]  # c10's insert_into_blocks
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
    *,
    capacity: int | None = None,
    allowed: int | None = None,
) -> AllocatorPeaks:
    """Peaks of the allocator over `events` ((key, +bytes) malloc, (key, -bytes) free).

    `preallocated` are blocks allocated first and never freed (the cuBLAS workspaces);
    `capacity` and `allowed` are the card's limits (see `CachingAllocatorModel`).
    """
    model = CachingAllocatorModel(settings=settings, capacity=capacity, allowed=allowed)
    for index, nbytes in enumerate(preallocated):
        if nbytes > 0:
            model.malloc(-1 - index, nbytes)
    for key, nbytes in events:
        if nbytes > 0:
            model.malloc(key, nbytes)
        else:
            model.free(key)
    return AllocatorPeaks(allocated=model.peak_allocated, reserved=model.peak_reserved)
