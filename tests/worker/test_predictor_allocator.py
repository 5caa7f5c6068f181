"""The caching-allocator model: segment sizes, best-fit reuse, splitting and merging."""

from __future__ import annotations

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
