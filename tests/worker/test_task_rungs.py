"""Which rungs each kind of task can take, answered in one place (worker/trial/rungs.py) and
used by the plan chooser, `vramtune tasks check` and the worker's registration (issue 43)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from tests.e2e.plain_widths import PlainWidths
from vramtune.service.wire import MemoryPolicy
from vramtune.worker.device.gpu import simulated_card
from vramtune.worker.loop.outcomes import error_message
from vramtune.worker.plan.policy import HandBack, RunAsPlanned, choose_plan
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.check_file import check_file
from vramtune.worker.trial.rungs import supported_rungs, task_can_checkpoint
from vramtune.worker.trial.runner import CardSpec
from vramtune.worker.trial.task import TaskConfigError

EXAMPLES = Path(__file__).parents[2] / "examples"
MIB = 2**20


class Mlp(PlainWidths):
    """A PlainTask without checkpoint_modules (the issue's 'my-mlp')."""

    name = "my-mlp"


class BlockMlp(Mlp):
    """The same with its first layer marked for recomputation."""

    name = "block-mlp"

    def checkpoint_modules(self, model: nn.Module) -> list[nn.Module]:
        return [model[0]]


class TrainerLike:
    """A runner that builds its own optimizer and step (as TrainerTask and LightningTask do)."""

    task_name = "trainer-like"
    can_checkpoint = True
    can_bf16 = True


def test_a_plain_task_without_blocks_supports_no_checkpointing() -> None:
    plain = TorchTaskRunner(Mlp())
    assert not task_can_checkpoint(plain.task) and not plain.can_checkpoint
    rungs = supported_rungs(plain, "cpu")
    assert "checkpointing" not in rungs and "selective_checkpointing" not in rungs
    assert rungs[0] == "micro_batch"
    blocks = TorchTaskRunner(BlockMlp())
    assert "checkpointing" in supported_rungs(blocks, "cpu")


def test_offloads_need_a_cuda_card_and_a_runner_that_owns_the_step() -> None:
    plain = TorchTaskRunner(Mlp())
    assert not {"activation_offload", "optimizer_offload"} & set(supported_rungs(plain, "cpu"))
    assert {"activation_offload", "optimizer_offload"} <= set(supported_rungs(plain, "cuda:0"))
    trainer: Any = TrainerLike()
    assert supported_rungs(trainer, "cuda:0") == ["micro_batch", "checkpointing", "bf16"]


def test_the_plan_chooser_resizes_a_plain_task_by_micro_batches_only() -> None:
    """The issue's repro: examples/plain_task.py's shape at width 2048, batch 512 on an 8 MiB
    card, under the default policy (which lists checkpointing)."""
    runner = TorchTaskRunner(Mlp())
    card = CardSpec(info=simulated_card(8 * MIB))
    config = {"width": 2048, "batch_size": 512}
    decision = choose_plan(runner, config, MemoryPolicy(), card, card.info.free_bytes)
    assert isinstance(decision, RunAsPlanned), decision
    assert not decision.plan.checkpointing and decision.plan.accumulation > 1, decision.plan
    wide = {"width": 65536, "batch_size": 512}  # its weights alone exceed the card
    back = choose_plan(runner, wide, MemoryPolicy(), card, card.info.free_bytes)
    assert isinstance(back, HandBack) and back.plan is not None, back
    assert not back.plan.checkpointing, back.plan


def test_tasks_check_says_which_rungs_and_not_ok_checkpointing(tmp_path: Path) -> None:
    report, code = check_file(
        str(EXAMPLES / "plain_task.py"),
        study=None,
        config='{"width": 16, "batch_size": 8}',
        device="cpu",
    )
    assert code == 0, report
    lines = report.splitlines()
    checkpointing = next(line for line in lines if "checkpointing" in line and "ok" in line)
    assert "none: the task marks no modules" in checkpointing, report
    rungs = next(line for line in lines if "supports the rungs" in line)
    assert "micro_batch" in rungs and "checkpointing" not in rungs, rungs


def test_a_configuration_without_the_batch_parameter_is_refused_naming_it() -> None:
    runner = TorchTaskRunner(Mlp())
    with pytest.raises(TaskConfigError, match=r"'batch_size'.*search_space"):
        runner.batch_size({"width": 8})
    assert "has no key 'batch_size'" in error_message(KeyError("batch_size"))
