"""bench/gpu_ranks.py, the GPU per-rank check, run here on what this machine has: its FSDP2 case
both ways (resharding after forward and keeping parameters gathered) on two gloo CPU ranks (where
the prediction is exact), its report, and its refusal without GPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_ranks
from vramtune.worker.device.gpu import parse_size, simulated_card
from vramtune.worker.tasks.digits import DigitsCNNTask
from vramtune.worker.trial.runner import CardSpec

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)  # the case spawns two processes that import torch


@pytest.mark.parametrize(
    ("reshard_after_forward", "shown"), [(True, "fsdp"), (False, "fsdp (kept gathered)")]
)
def test_a_case_on_two_cpu_ranks_measures_every_rank_against_the_prediction(
    reshard_after_forward: bool, shown: str
) -> None:
    config = {"width": 8, "depth": 2, "resolution": 16, "batch_size": 16, "lr": 0.05}
    card = CardSpec(info=simulated_card(parse_size("64MiB")))
    case = gpu_ranks.one_case(
        DigitsCNNTask(), config, "fsdp", ["cpu", "cpu"], card, reshard_after_forward
    )
    assert case["world_size"] == 2 and len(case["measured_allocated"]) == 2
    assert case["reshard_after_forward"] is reshard_after_forward
    # gloo ranks on CPU: resharding after forward is exact (bench/results/
    # distributed_prediction.md). Keeping parameters gathered is not always: on this tiny CNN a
    # rank measured 5,120 B (1.3 %) over its prediction in 13 of 30 back-to-back runs, exact in
    # the rest (a timing race of gloo's background work, a known defect: docs/concepts/
    # multi-gpu.md). The bench reports it as it is; here its row is checked, bounded at 2 %.
    bound = 0.001 if reshard_after_forward else 0.02
    assert all(abs(error) < bound for error in case["allocated_error"]), case
    report = gpu_ranks.render(
        {"started": "now", "device": "cpu", "gpus": 2, "torch": "x", "load": "1.0", "cases": [case]}
    )
    assert f"| digits-cnn | {shown} | 2 | 16 |" in report


def test_a_failed_case_is_a_row_not_a_crash() -> None:
    failed = {"task": "hf-causal-lm", "strategy": "ddp", "world_size": 4, "error": "OOM"}
    report = gpu_ranks.render(
        {
            "started": "now",
            "device": "H100",
            "gpus": 4,
            "torch": "x",
            "load": "1",
            "cases": [failed],
        }
    )
    assert "| hf-causal-lm | ddp | 4 | | failed: OOM |" in report


def test_without_two_gpus_it_says_so_and_writes_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "bench/gpu_ranks.py", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1  # sys.exit(message)
    assert "per-rank runs need 2 or more" in done.stderr
    assert list(tmp_path.iterdir()) == []
