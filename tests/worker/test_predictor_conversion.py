"""Models that cannot be built under fake tensors are built outside the fake mode and converted.

Models of our own stand in for timm's RegNet (`torch.unique` while building) and DeiT with a
custom image size (`.item()` while building): timm needs torchvision, which would replace this
machine's CPU torch. peft's LoRA (the meta path) is in test_lora.py. Cost: ~10 s (tiny models,
a few real CPU steps).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from test_predictor import _SmallTask, measured_cpu_peak
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from vramtune.service.wire import Plan
from vramtune.worker.device.memory import MemoryTracker
from vramtune.worker.predictor import clear_cache, predict
from vramtune.worker.predictor.conversion import to_fake
from vramtune.worker.predictor.trace import CPU_TARGET, CannotTrace, trace_training
from vramtune.worker.trial.task import Batch, Config

PLANS = [Plan(), Plan(micro_batch=2, accumulation=2), Plan(checkpointing=True)]


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_cache()
    yield
    clear_cache()


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.linear(x)) + x
        return out


class _StagewiseLM(nn.Module):
    """Stage widths read from tensors while building (as timm's RegNet and DeiT do), the
    output head tied to the embedding, and a buffer that views another buffer's storage."""

    def __init__(self, width: int) -> None:
        super().__init__()
        widths = torch.tensor([width, width, width // 2 * 2])
        (stage_width,) = torch.unique(widths).tolist()  # a data-dependent output shape
        depth = int(torch.tensor(2.0).item())  # a value read in Python
        self.embed = nn.Embedding(50, stage_width)
        self.blocks = nn.Sequential(*(_Block(stage_width) for _ in range(depth)))
        self.head = nn.Linear(stage_width, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("table", torch.zeros(4, stage_width))
        self.register_buffer("row", self.table[1])  # a view of the table's storage

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.embed(codes) + self.row))
        return out


class StagewiseTask(_SmallTask):
    name = "test-stagewise"

    def build_model(self, config: Config) -> nn.Module:
        return _StagewiseLM(int(config["width"]))

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        return (
            torch.randint(0, 50, (micro_batch, 8), device=device),
            torch.randint(0, 50, (micro_batch, 8), device=device),
        )

    def checkpoint_modules(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, _Block)]


CONFIG = {"width": 48, "batch_size": 4}


def test_the_model_does_not_build_under_fake_tensors() -> None:
    with FakeTensorMode(), pytest.raises(Exception, match=r"unique|data-dependent|dynamic"):
        _StagewiseLM(48)


@pytest.mark.parametrize("plan", PLANS, ids=["asked", "micro-batches", "checkpointing"])
def test_a_model_built_outside_the_fake_mode_is_traced_exactly(plan: Plan) -> None:
    task = StagewiseTask()
    prediction = predict(task, CONFIG, plan)
    assert prediction.method == "trace", prediction.reason
    assert prediction.peak_allocated_bytes == measured_cpu_peak(task, CONFIG, plan)


def test_conversion_keeps_tied_parameters_and_shared_storages_shared() -> None:
    model = _StagewiseLM(48)
    parameters = len(list(model.parameters()))
    tracker = MemoryTracker(device_type="cpu", round_to=1)
    with FakeTensorMode(), tracker:
        to_fake(model, torch.device("cpu"))
    assert isinstance(model.embed.weight, FakeTensor)
    assert model.head.weight is model.embed.weight
    assert len(list(model.parameters())) == parameters
    table, row = model.get_buffer("table"), model.get_buffer("row")
    assert row.untyped_storage()._cdata == table.untyped_storage()._cdata
    assert row.storage_offset() == 48
    # Counted once each, as the real model holds them: one embedding, two blocks, the table.
    expected = sum(p.numel() * p.element_size() for p in model.parameters()) + table.nbytes
    assert tracker.live_bytes == expected


class _NeverBuilds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        raise RuntimeError("no such layer")


class NeverBuildsTask(StagewiseTask):
    name = "test-never-builds"

    def build_model(self, config: Config) -> nn.Module:
        return _NeverBuilds()


def test_a_model_that_builds_no_way_says_each_reason() -> None:
    with pytest.raises(CannotTrace) as raised:
        trace_training(NeverBuildsTask(), CONFIG, Plan(), CPU_TARGET)
    assert "under fake tensors" in raised.value.reason
    assert "on meta: RuntimeError: no such layer" in raised.value.reason
    assert "on cpu: RuntimeError: no such layer" in raised.value.reason
    # The probe cannot build it either: a prediction with the reason, not an exception.
    prediction = predict(NeverBuildsTask(), CONFIG, Plan())
    assert prediction.method == "none"
    assert "no such layer" in prediction.reason


class _PooledBatchNorm(nn.Module):
    """Batch norm over a 1 x 1 map: it needs more than one example per channel in training."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 1e9:  # untraceable: the predictor falls back to the probe
            raise ValueError("diverged")
        out: torch.Tensor = self.head(self.norm(self.pool(self.conv(x))).flatten(1))
        return out


class PooledBatchNormTask(_SmallTask):
    name = "test-pooled-batch-norm"

    def build_model(self, config: Config) -> nn.Module:
        return _PooledBatchNorm()

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        return (
            torch.randn(micro_batch, 3, 32, 32, device=device),
            torch.randint(0, 10, (micro_batch,), device=device),
        )


def test_a_probe_that_raises_returns_its_reason() -> None:
    """At batch 2 the probe measures micro-batch 1, where batch norm raises ValueError."""
    prediction = predict(PooledBatchNormTask(), {"width": 0, "batch_size": 2}, Plan())
    assert prediction.method == "none"
    assert "the probe failed at micro-batch 1" in prediction.reason
    assert "ValueError" in prediction.reason
    assert "more than 1 value per channel" in prediction.reason
