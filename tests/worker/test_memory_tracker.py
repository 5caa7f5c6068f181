"""The live-storage tracker: rounding, views, frees, peaks, phases, the simulated card's limit."""

from __future__ import annotations

import contextlib
import pickle

import pytest
import torch
from torch import nn

from vramtune.worker.device.memory import CATEGORIES, MemoryLimitExceeded, MemoryTracker, round_up


def test_a_storage_counts_once_rounded_to_512_and_is_uncounted_when_it_dies() -> None:
    tracker = MemoryTracker()
    with tracker:
        tensor = torch.empty(100, dtype=torch.float32)  # 400 bytes -> 512
        view = tensor[10:20].view(2, 5)
        assert tracker.live_bytes == 512
        del tensor
        assert tracker.live_bytes == 512  # the view keeps the storage alive
        del view
    assert tracker.live_bytes == 0
    assert tracker.peak_bytes == 512


def test_rounding_is_configurable_and_zero_bytes_stay_zero() -> None:
    tracker = MemoryTracker(round_to=1)
    with tracker:
        kept = [torch.empty(3, dtype=torch.uint8), torch.empty(0)]
    assert tracker.live_bytes == 3
    assert round_up(0, 512) == 0
    assert round_up(513, 512) == 1024
    del kept


def test_peak_follows_the_highest_live_bytes_and_resets_to_live() -> None:
    tracker = MemoryTracker(round_to=1)
    with tracker:
        big = torch.empty(1000, dtype=torch.uint8)
        small = torch.empty(10, dtype=torch.uint8)
        del big
        assert (tracker.live_bytes, tracker.peak_bytes) == (10, 1010)
        tracker.reset_peak()
        assert tracker.peak_bytes == 10
        again = torch.empty(5, dtype=torch.uint8)
    assert tracker.peak_bytes == 15
    del small, again


def test_only_the_tracked_device_type_counts() -> None:
    tracker = MemoryTracker(device_type="cuda")
    with tracker:
        kept = torch.empty(1000)
    assert tracker.peak_bytes == 0
    del kept


def test_tensors_made_before_entering_count_only_when_tracked() -> None:
    model = nn.Linear(64, 64)  # 16,384 + 256 bytes
    tracker = MemoryTracker()
    with tracker:
        assert tracker.live_bytes == 0
        tracker.track(model)
    assert tracker.live_bytes == 16384 + 512
    assert tracker.breakdown()["parameters"] == 16384 + 512


def test_the_limit_raises_a_torch_oom_and_counts_nothing_of_the_failed_op() -> None:
    tracker = MemoryTracker(round_to=1, limit_bytes=1000)
    with tracker:
        kept = torch.empty(600, dtype=torch.uint8)
        with pytest.raises(MemoryLimitExceeded) as raised:
            torch.empty(500, dtype=torch.uint8)
        assert tracker.live_bytes == 600
    error = raised.value
    assert isinstance(error, torch.OutOfMemoryError)
    assert (error.requested, error.live, error.limit) == (500, 600, 1000)
    assert "out of memory" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.requested, copy.live, copy.limit) == (500, 600, 1000)
    del kept


def test_the_limit_reached_in_backward_propagates_as_memory_limit_exceeded() -> None:
    weight = torch.randn(256, 256, requires_grad=True)
    inputs = torch.randn(64, 256)
    tracker = MemoryTracker(limit_bytes=10**9)
    with tracker:
        loss = (inputs @ weight).relu().sum()
        tracker.limit_bytes = tracker.live_bytes  # the backward's first allocation exceeds it
        with pytest.raises(MemoryLimitExceeded) as raised:
            loss.backward()  # type: ignore[no-untyped-call]
    assert raised.value.limit == raised.value.live
    assert weight.grad is None


def test_breakdown_labels_training_state_and_splits_the_rest_by_phase() -> None:
    tracker = MemoryTracker()
    with tracker:
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        optimizer = torch.optim.Adam(model.parameters())
        tracker.watch_optimizer(optimizer)
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            model(torch.randn(16, 32)).square().mean().backward()
            optimizer.step()
            tracker.label_training_state(model, optimizer)
    breakdown = tracker.breakdown()
    assert set(breakdown) == set(CATEGORIES)
    parameter_bytes = sum(round_up(p.numel() * 4, 512) for p in model.parameters())
    assert breakdown["parameters"] == parameter_bytes
    assert breakdown["gradients"] == parameter_bytes
    assert breakdown["optimizer_state"] >= 2 * parameter_bytes
    assert sum(breakdown.values()) == tracker.peak_bytes


def test_phase_blocks_attribute_new_storages() -> None:
    tracker = MemoryTracker()
    with tracker:
        with tracker.phase("setup"):
            assert tracker.current_phase() == "setup"
            kept = torch.empty(10)
        assert tracker.current_phase() == "forward"
    assert tracker.breakdown()["temporaries"] == 512  # neither forward nor labelled
    del kept


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_a_storage_resized_in_place_is_freed_and_counted_again(fake: bool) -> None:
    """`UntypedStorage.resize_` is no operator: FSDP2 frees an all-gathered parameter with
    resize_(0) and brings it back with resize_(n); the tracker follows both (issue 31)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracker = MemoryTracker(round_to=1, record_events=True)
    with FakeTensorMode() if fake else contextlib.nullcontext(), tracker:
        tensor = torch.empty(1000, dtype=torch.uint8)
        storage = tensor.untyped_storage()
        storage.resize_(0)
        assert tracker.live_bytes == 0
        other = torch.empty(300, dtype=torch.uint8)
        storage.resize_(1000)
        assert tracker.live_bytes == 1300
        storage.resize_(0)
    assert (tracker.live_bytes, tracker.peak_bytes) == (300, 1300)
    assert [n for _, n in tracker.events or []] == [1000, -1000, 300, 1000, -1000]
    del tensor, other


def test_a_resize_outside_the_tracker_or_of_an_untracked_storage_counts_nothing() -> None:
    before = torch.empty(1000, dtype=torch.uint8)
    tracker = MemoryTracker(round_to=1)
    with tracker:
        before.untyped_storage().resize_(2000)  # made before the tracker: not its memory
        kept = torch.empty(100, dtype=torch.uint8)
    kept.untyped_storage().resize_(5000)  # after leaving it: not seen
    assert (tracker.live_bytes, tracker.peak_bytes) == (100, 100)
    with tracker:
        kept.untyped_storage().resize_(0)
    assert tracker.live_bytes == 0


def test_a_resize_past_the_limit_raises_the_simulated_oom() -> None:
    tracker = MemoryTracker(round_to=1, limit_bytes=1500)
    with tracker:
        kept = torch.empty(1000, dtype=torch.uint8)
        kept.untyped_storage().resize_(0)
        kept.untyped_storage().resize_(1200)
        with pytest.raises(MemoryLimitExceeded):
            kept.untyped_storage().resize_(2000)
    assert tracker.peak_bytes == 1200
