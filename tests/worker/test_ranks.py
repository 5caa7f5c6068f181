"""A trial on several simulated cards: one spawned gloo process per rank, per-rank peaks, faults.

Cost: about a minute on two loaded cores (each run spawns 2 processes that import torch).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import pytest

from vramtune.service.wire import Plan, TrainBudget
from vramtune.worker.cli import node_devices
from vramtune.worker.device.gpu import parse_size, simulated_card
from vramtune.worker.predictor.distributed import trace_rank
from vramtune.worker.run.ranks import RankGroupRunner, backend_for, rank_config, rank_device
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.digits import DigitsCNNTask
from vramtune.worker.trial.runner import CardSpec, OutOfMemory, RunFailed, Stopped

pytestmark = pytest.mark.timeout(900)  # each run spawns processes that import torch
TASK = DigitsCNNTask()
CONFIG = {"width": 8, "depth": 2, "resolution": 16, "batch_size": 16, "lr": 0.05}
CARD = CardSpec(info=simulated_card(parse_size("64MiB")))


class _Quiet:
    """A reporter that never prunes and stops when told to (a test's stand-in for the agent)."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, float]] = []
        self.stop: str | None = None

    def report(self, step: int, value: float) -> bool:
        self.reports.append((step, value))
        return False

    def stop_reason(self) -> str | None:
        return self.stop


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead but not yet reaped
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_rank_sees_one_gpu_and_nccl_between_gpus() -> None:
    assert rank_device("cuda:3") == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "3"})
    assert rank_device("cpu") == ("cpu", {})
    assert backend_for("cuda:1") == "nccl"
    assert backend_for("cpu") == "gloo"


def test_each_rank_gets_its_share_of_the_global_batch() -> None:
    assert rank_config(CONFIG, "batch_size", 4)["batch_size"] == 4
    with pytest.raises(RunFailed, match="batch_size=16 does not split evenly over 3 ranks"):
        rank_config(CONFIG, "batch_size", 3)


def _args(**given: object) -> argparse.Namespace:
    defaults = {
        "devices": None, "ranks": None, "device": "cuda:0", "memory_limit": None,
        "max_trials_per_card": 1,
    }  # fmt: skip
    return argparse.Namespace(**{**defaults, "node": False, "all_gpus": False, **given})


def test_node_cards_come_from_devices_or_ranks() -> None:
    assert node_devices(_args(devices="cuda:0,cuda:2")) == ("cuda:0", "cuda:2")
    assert node_devices(_args(ranks=4, device="cpu", memory_limit=1)) == ("cpu",) * 4
    assert node_devices(_args()) == ()
    with pytest.raises(ValueError, match="--devices takes distinct cuda:N"):
        node_devices(_args(devices="cuda:0,cuda:0"))
    with pytest.raises(ValueError, match="--ranks simulates cards"):
        node_devices(_args(ranks=2))
    with pytest.raises(ValueError, match="a node runs one trial per card"):
        node_devices(_args(ranks=2, device="cpu", memory_limit=1, max_trials_per_card=2))


@pytest.mark.parametrize(("strategy", "reshard"), [("ddp", True), ("fsdp", True), ("fsdp", False)])
def test_two_ranks_train_and_each_measures_its_own_peak(strategy: str, reshard: bool) -> None:
    plan = Plan(world_size=2, strategy=strategy, reshard_after_forward=reshard)
    reporter = _Quiet()
    budget = TrainBudget(max_steps=2, eval_every=2)
    result = RankGroupRunner(TorchTaskRunner(TASK), ["cpu", "cpu"]).run(
        CONFIG, plan, budget, CARD, reporter
    )
    peaks = result.measured.rank_peak_bytes
    assert peaks is not None and len(peaks) == 2
    assert result.measured.peak_allocated_bytes == max(peaks)
    assert [step for step, _ in reporter.reports] == [2]  # rank 0 reported, once
    assert result.values == [reporter.reports[0][1]]
    predicted = trace_rank(TASK, CONFIG, plan, plan.strategy or "ddp", 2).allocated_bytes
    # Evaluation runs under the training peak (vramtune/worker/run/training.py drops the gradients).
    assert peaks[0] == pytest.approx(predicted, rel=0.001)


def test_a_rank_past_its_card_ends_the_trial_out_of_memory_naming_it() -> None:
    runner = RankGroupRunner(TorchTaskRunner(TASK), ["cpu", "cpu"])
    tiny = CardSpec(info=simulated_card(parse_size("64KiB")))
    with pytest.raises(OutOfMemory, match=r"rank \d: "):
        runner.run(CONFIG, Plan(world_size=2, strategy="ddp"), TrainBudget(), tiny, _Quiet())
    assert runner.pids == []


def test_a_rank_killed_mid_trial_fails_the_trial_and_leaves_no_rank_behind() -> None:
    runner = RankGroupRunner(TorchTaskRunner(TASK), ["cpu", "cpu"])
    reporter = _Quiet()
    outcome: list[BaseException] = []
    plan = Plan(world_size=2, strategy="ddp")
    long_run = TrainBudget(max_steps=10**6, eval_every=1)  # rank 0 reports every step

    def run() -> None:
        try:
            runner.run(CONFIG, plan, long_run, CARD, reporter)
        except BaseException as error:  # the test reads it
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    while len(runner.pids) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = list(runner.pids)
    assert len(pids) == 2
    while not reporter.reports and time.monotonic() < deadline:
        time.sleep(0.1)  # until the ranks have joined their group and trained a step
    assert reporter.reports
    os.kill(pids[1], signal.SIGKILL)
    thread.join(120)
    assert not thread.is_alive()
    [error] = outcome
    assert isinstance(error, RunFailed)
    assert "rank 1 died (killed by SIGKILL)" in str(error)
    assert not any(_alive(pid) for pid in pids)


def test_a_stop_reaches_every_rank_and_the_run_says_why() -> None:
    """SIGTERM to the worker (its reporter says "interrupted"): every rank stops at the same
    step, the trial goes back as interrupted, and no rank is left."""
    runner = RankGroupRunner(TorchTaskRunner(TASK), ["cpu", "cpu"])
    reporter = _Quiet()
    plan = Plan(world_size=2, strategy="fsdp")
    long_run = TrainBudget(max_steps=10**6, eval_every=10**6)
    timer = threading.Timer(20.0, lambda: setattr(reporter, "stop", "interrupted"))
    timer.start()
    try:
        with pytest.raises(Stopped) as stopped:
            runner.run(CONFIG, plan, long_run, CARD, reporter)
    finally:
        timer.cancel()
    assert stopped.value.reason == "interrupted"
    assert stopped.value.measured is not None and stopped.value.measured.peak_allocated_bytes > 0
    assert runner.pids == []
