"""The caching-allocator model: segment sizes, best-fit reuse, splitting and merging."""

from __future__ import annotations

from vramtune.service.wire import CardConstants, CardInfo
from vramtune.worker.device.alloc_conf import parse
from vramtune.worker.predictor import CPU_TARGET, EMULATED_CUDA_TARGET, from_trace
from vramtune.worker.predictor.allocator import (
    CachingAllocatorModel,
    replay,
    round_request,
    segment_size,
)
from vramtune.worker.predictor.core import allocator_capacity
from vramtune.worker.predictor.trace import Trace, TrainingPart
from vramtune.worker.trial.runner import CardSpec

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


def test_the_allocator_frees_its_cache_and_retries_before_an_oom() -> None:
    model = CachingAllocatorModel(capacity=100 * MiB)
    model.malloc(1, 40 * MiB)
    model.malloc(2, 40 * MiB)
    model.free(1)  # a whole free 40 MiB segment, too small for the next request
    model.malloc(3, 50 * MiB)  # 80 + 50 > 100: the free segment goes back first
    assert (model.reserved, model.peak_reserved, model.ooms) == (90 * MiB, 90 * MiB, 0)
    model.malloc(4, 20 * MiB)  # nothing cached left to free: the real allocator raises
    assert model.ooms == 1
    assert model.peak_reserved == 110 * MiB  # made anyway, so the peak shows it does not fit


def test_with_max_split_size_the_retry_frees_one_large_enough_block_first() -> None:
    # c10's release_available_cached_blocks: the smallest whole free block at least as large
    # as the request goes back, and the rest of the cache stays.
    model = CachingAllocatorModel(settings=parse("max_split_size_mb:32"), capacity=150 * MiB)
    model.malloc(1, 100 * MiB)
    model.malloc(2, 4 * MiB)  # a 20 MiB segment
    model.free(1)
    model.free(2)
    model.malloc(3, 40 * MiB)  # the 100 MiB block wastes >= 20 MiB: not taken; 160 > 150
    assert model.reserved == 20 * MiB + 40 * MiB
    everything = CachingAllocatorModel(capacity=150 * MiB)  # no max_split_size: all goes
    everything.malloc(1, 100 * MiB)
    everything.malloc(2, 4 * MiB)
    everything.free(2)
    everything.malloc(3, 40 * MiB)  # 120 + 40 > 150: release_cached_blocks frees the 20
    assert everything.reserved == 140 * MiB


def test_with_expandable_segments_the_retry_unmaps_free_pages() -> None:
    model = CachingAllocatorModel(settings=parse("expandable_segments:True"), capacity=60 * MiB)
    model.malloc(1, 30 * MiB, stream=1)  # two 20 MiB pages on stream 1
    model.free(1)
    model.malloc(2, 30 * MiB, stream=0)  # 40 + 40 > 60: stream 1's free pages are unmapped
    assert (model.reserved, model.peak_reserved, model.ooms) == (40 * MiB, 40 * MiB, 0)
    assert model.segment_sizes == [40 * MiB, 40 * MiB]


def _aged(settings: str, allowed: int | None) -> CachingAllocatorModel:
    # Two whole free segments of different ages (counted in large-pool searches), then a
    # request no free block fits.
    model = CachingAllocatorModel(settings=parse(settings), allowed=allowed)
    model.malloc(1, 20 * MiB)
    model.malloc(2, 22 * MiB)
    model.free(1)  # 20 MiB free: age 0 now
    model.malloc(3, 30 * MiB)  # a new segment; the 20 MiB block is one search older
    model.malloc(4, 1000)  # the small pool's searches age no large block
    model.free(2)  # 22 MiB free: age 0
    model.malloc(5, 40 * MiB)  # ages 2 and 1, average 1.5
    return model


def test_garbage_collection_frees_the_blocks_older_than_average_above_the_threshold() -> None:
    # 0.3 x 200 MiB = 60 MiB; 74 MiB reserved before the 40 MiB segment: 14 MiB to reclaim.
    # The 20 MiB block (age 2 >= 1.5) goes and is enough; the younger 22 MiB one stays.
    model = _aged("garbage_collection_threshold:0.3", allowed=200 * MiB)
    assert model.reserved == (22 + 30 + 2 + 40) * MiB
    # Without the fraction set the allocator never collects (c10 checks set_fraction).
    assert _aged("garbage_collection_threshold:0.3", allowed=None).reserved == 114 * MiB
    assert _aged("", allowed=200 * MiB).reserved == 114 * MiB
    # A threshold the reserve is under collects nothing; one far below frees both, pass by pass.
    assert _aged("garbage_collection_threshold:0.5", allowed=200 * MiB).reserved == 114 * MiB
    assert _aged("garbage_collection_threshold:0.1", allowed=200 * MiB).reserved == 72 * MiB


def test_a_prediction_near_the_cards_capacity_gets_the_reserve_after_the_retry() -> None:
    info = CardInfo(model="test", total_bytes=2**30, free_bytes=2**30)
    constants = {"cuda_context_bytes": 500 * MiB, "other_bytes": 424 * MiB}
    card = CardSpec(info=info, device="cuda:0", constants=constants)
    assert allocator_capacity(card, EMULATED_CUDA_TARGET) == 100 * MiB
    assert allocator_capacity(card, CPU_TARGET) is None
    assert allocator_capacity(CardSpec(info=info, device="cpu"), EMULATED_CUDA_TARGET) is None
    events = [(1, 40 * MiB), (2, 40 * MiB), (1, -40 * MiB), (3, 50 * MiB)]
    trace = Trace(0, {}, events, 0.0, {}, TrainingPart(0, len(events), None))
    none = CardConstants()
    unlimited = from_trace(trace, EMULATED_CUDA_TARGET, none, 0.0)
    near = from_trace(trace, EMULATED_CUDA_TARGET, none, 0.0, capacity=100 * MiB)
    assert (unlimited.peak_reserved_bytes, near.peak_reserved_bytes) == (130 * MiB, 90 * MiB)
