"""`vramtune.fit`: the predictor on its own, on plain PyTorch code, against real CPU runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from task_contract import run_trial
from torch import nn

import vramtune
from vramtune.worker.device.memory import MemoryTracker
from vramtune.worker.fit.adapter import ModuleTask
from vramtune.worker.fit.cards import CARDS, GIB, RESERVED_BYTES, card_named
from vramtune.worker.predictor import clear_cache

KIB = 1024


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_cache()
    yield
    clear_cache()


class Net(nn.Module):
    """Plain PyTorch, nothing of vramtune's: two blocks and a head."""

    def __init__(self, width: int = 96) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(2)
        )
        self.embed = nn.Linear(32, width)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def example(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, 32, generator=generator), torch.randint(0, 10, (n,), generator=generator)


def user_step(model: nn.Module, batch: tuple[torch.Tensor, ...], optimizer: torch.optim.Optimizer):
    """A user's loop body that keeps `loss` alive through backward and the optimizer step."""
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def measured_user_loop(batch_size: int, steps: int = 2) -> int:
    """The user's own loop run for real on the CPU, measured by the worker's tracker."""
    x, y = example(batch_size)
    with MemoryTracker(device_type="cpu") as tracker:
        model = Net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for batch in ((x.clone(), y.clone()) for _ in range(steps)):
            out = user_step(model, batch, optimizer)
        del out
    return tracker.peak_bytes


def test_a_plain_module_with_vramtunes_step_is_predicted_to_the_byte() -> None:
    x, y = example()
    result = vramtune.fit(Net(), (x, y), loss=cross_entropy, cards=["T4"], device="cpu")
    # The worker's own loop on the CPU card, measured as every trial is (CpuPeakMeter).
    task = ModuleTask(Net(), (x, y), loss=cross_entropy)
    measured = run_trial(task, {"batch_size": 24}, steps=2).measured
    assert result.peak_bytes == measured.training_peak_bytes
    assert result.method == "trace" and result.evaluation_bytes is None
    assert result.peak_phase in ("forward", "backward", "optimizer")
    assert set(result.breakdown) >= {"parameters", "gradients", "optimizer_state", "activations"}
    params = sum(p.numel() * 4 for p in Net().parameters())
    assert result.breakdown["parameters"] >= params
    assert result.fits("T4") and result.card("T4").largest_micro_batch == 24


def test_a_users_own_step_is_traced_as_written_to_the_byte() -> None:
    result = vramtune.fit(Net, example(), step=user_step, cards=["T4"], device="cpu")
    assert result.own_step and result.peak_bytes == measured_user_loop(24)
    # A builder of batches at another size: the same loop, measured at that size.
    builder = vramtune.fit(
        Net,
        lambda n: (torch.randn(n, 32), torch.randint(0, 10, (n,))),
        step=user_step,
        batch_size=40,
        cards=[],
        device="cpu",
    )
    assert builder.peak_bytes == measured_user_loop(40)


def test_a_card_too_small_gets_a_plan_or_the_gap_and_the_largest_micro_batch() -> None:
    x, y = example(64)
    asked = vramtune.fit(Net(), (x, y), loss=cross_entropy, cards=[], device="cpu")
    one = vramtune.fit(Net(), (x, y), loss=cross_entropy, batch_size=1, cards=[], device="cpu")
    between = f"{(asked.peak_bytes + one.peak_bytes) // 2}B"
    tiny = f"{one.peak_bytes // 2}B"
    result = vramtune.fit(Net(), (x, y), loss=cross_entropy, cards=[between, tiny], device="cpu")
    planned, hopeless = result.cards
    assert planned.verdict == "fits with a plan" and planned.plan_in_words
    assert planned.plan_footprint_bytes is not None
    assert planned.plan_footprint_bytes <= planned.usable_bytes
    assert planned.largest_micro_batch is not None and 1 <= planned.largest_micro_batch < 64
    assert hopeless.verdict == "does not fit" and hopeless.largest_micro_batch is None
    assert hopeless.short_by_bytes is not None and hopeless.short_by_bytes > 0
    # With the user's own step nothing is resized: the gap, and the largest batch that fits.
    own = vramtune.fit(Net, (x, y), step=user_step, cards=[between], device="cpu").cards[0]
    assert own.verdict == "does not fit" and own.short_by_bytes
    assert own.largest_micro_batch is not None and 1 <= own.largest_micro_batch < 64


def test_a_cuda_card_is_predicted_with_its_allocator() -> None:
    result = vramtune.fit(Net(), example(), loss=cross_entropy, cards=["H100", "1MiB"])
    assert result.device == "cuda" and result.peak_bytes >= result.allocated_bytes
    assert [c.verdict for c in result.cards] == ["fits", "does not fit"]


def test_a_vramtune_task_is_fitted_from_its_configuration() -> None:
    from vramtune.worker.tasks.digits import DigitsMLPTask

    config = {"width": 64, "depth": 2, "resolution": 8, "batch_size": 16}
    result = vramtune.fit(DigitsMLPTask(), config=config, cards=["T4"], device="cpu")
    measured = run_trial(DigitsMLPTask(), config, steps=2).measured
    assert result.peak_bytes == measured.peak_allocated_bytes
    assert result.evaluation_bytes == measured.evaluation_peak_bytes
    with pytest.raises(ValueError, match="config: the task's batch size 'batch_size'"):
        vramtune.fit(DigitsMLPTask(), config={"width": 64, "depth": 2, "resolution": 8})


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="optimizer: unknown name 'adamx'"):
        vramtune.fit(Net(), example(), optimizer="adamx")
    with pytest.raises(ValueError, match="unknown card 'H1000'"):
        vramtune.fit(Net(), example(), cards=["H1000"])
    with pytest.raises(ValueError, match="batch_size: required"):
        vramtune.fit(Net(), lambda n: torch.zeros(n, 32))
    with pytest.raises(ValueError, match="plan: your own step"):
        vramtune.fit(Net(), example(), step=user_step, plan=vramtune.Plan(bf16=True))


def test_the_card_table_is_nominal_less_the_allowance_and_takes_sizes() -> None:
    assert CARDS["H100"].nominal_bytes == 80 * GIB
    assert CARDS["T4"].usable_bytes == 16 * GIB - RESERVED_BYTES
    assert card_named("nvidia h100") is CARDS["H100"] and card_named("a100") is CARDS["A100-80GB"]
    assert card_named("8GiB").usable_bytes == 8 * GIB
    added = vramtune.register_card("tiny-test-card", 512 * KIB)
    try:
        assert card_named("TINY-TEST-CARD") == added
    finally:
        del CARDS["tiny-test-card"]


def test_the_users_module_is_left_as_it_was() -> None:
    model = Net()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    vramtune.fit(model, example(), loss=cross_entropy, cards=[], device="cpu")
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert all(not type(t).__name__.startswith("Fake") for t in after.values())
