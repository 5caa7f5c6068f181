"""The caching-allocator model: segment sizes, best-fit reuse, splitting and merging."""

from __future__ import annotations

from vramtune.worker.device.alloc_conf import parse
from vramtune.worker.predictor.allocator import (
    CachingAllocatorModel,
    replay,
    round_request,
    segment_size,
)

MiB = 2**20


def test_requests_round_to_512_and_segments_follow_the_size_classes() -> None:
    assert round_request(1) == 512
    assert round_request(513) == 1024
    assert segment_size(512) == 2 * MiB
    assert segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(11 * MiB + 1) == 12 * MiB


def test_small_requests_share_a_2_mib_segment() -> None:
    peaks = replay([(key, 1000) for key in range(100)])
    assert peaks.reserved == 2 * MiB
    assert peaks.allocated == 100 * 1024


def test_a_freed_block_is_reused_and_neighbours_merge() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 4 * MiB)  # a 20 MiB segment, split: 4 MiB used, 16 MiB free
    model.malloc(2, 4 * MiB)  # the same segment
    assert model.reserved == 20 * MiB
    model.free(1)
    model.free(2)  # merges back into one 20 MiB free block
    model.malloc(3, 18 * MiB)
    assert model.reserved == 20 * MiB
    assert model.allocated == 18 * MiB


def test_a_large_block_is_not_split_for_a_rest_under_1_mib() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 12 * MiB)
    model.free(1)
    model.malloc(2, 11 * MiB + 512)  # 12 MiB block, rest below 1 MiB: handed out whole
    assert model.allocated == 12 * MiB


def test_fragmentation_reserves_more_than_the_live_peak() -> None:
    events: list[tuple[int, int]] = []
    for key in range(10):
        events.append((key, 12 * MiB))
    for key in range(0, 10, 2):
        events.append((key, -12 * MiB))
    events.append((100, 24 * MiB))  # no free 24 MiB block: a new segment
    peaks = replay(events)
    assert peaks.reserved == 10 * 12 * MiB + 24 * MiB
    assert peaks.allocated == 10 * 12 * MiB


def test_preallocated_workspaces_are_counted_first() -> None:
    peaks = replay([(1, 1000)], preallocated=[32 * MiB])
    assert peaks.reserved == 32 * MiB + 2 * MiB
    assert peaks.allocated == 32 * MiB + 1024


def test_roundup_power2_divisions_round_to_the_next_step() -> None:
    settings = parse("roundup_power2_divisions:4")
    assert round_request(5 * MiB + 1, settings) == 6 * MiB  # steps of 1 MiB between 4 and 8
    assert round_request(8 * MiB, settings) == 8 * MiB  # a power of two stays
    assert round_request(1200, settings) == 1536  # below 4 x 512 B: the 512 B rounding
    assert round_request(3000, settings) == 3072
    model = CachingAllocatorModel(settings=settings)
    model.malloc(1, 5 * MiB + 1)
    assert model.allocated == 6 * MiB


def test_max_split_size_keeps_large_blocks_whole() -> None:
    model = CachingAllocatorModel(settings=parse("max_split_size_mb:64"))
    model.malloc(1, 100 * MiB)
    model.free(1)
    model.malloc(2, 30 * MiB)  # below the limit: never served from a block above it
    assert model.reserved == 130 * MiB
    model.free(2)
    model.malloc(3, 90 * MiB)  # wastes 10 MiB < 20 MiB: takes the 100 MiB block, unsplit
    assert model.allocated == 100 * MiB
    assert model.reserved == 130 * MiB
    model.malloc(4, 70 * MiB)  # the 100 MiB block is taken; 30 MiB wastes nothing but is small
    assert model.reserved == 200 * MiB


def test_expandable_segments_grow_by_pages() -> None:
    default = CachingAllocatorModel()
    default.malloc(1, 11 * MiB)
    default.free(1)
    default.malloc(2, 30 * MiB)
    assert default.reserved == 12 * MiB + 30 * MiB
    model = CachingAllocatorModel(settings=parse("expandable_segments:True"))
    model.malloc(1, 11 * MiB)  # one 20 MiB page of the large pool
    assert model.reserved == 20 * MiB
    model.free(1)
    model.malloc(2, 30 * MiB)  # the free 20 MiB at the end grows by one more page
    assert model.reserved == 40 * MiB
    model.malloc(3, 1000)  # the small pool maps 2 MiB pages
    assert model.reserved == 42 * MiB
    assert model.segment_sizes == [20 * MiB, 20 * MiB, 2 * MiB]


def test_streams_have_their_own_pools_and_empty_cache_releases_whole_segments() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 1000, stream=0)
    model.free(1)
    model.malloc(2, 1000, stream=1)  # the free block belongs to stream 0
    assert model.reserved == 4 * MiB
    model.release_cached()  # stream 0's segment is one free block: given back
    assert model.reserved == 2 * MiB
