"""bench/tuning_efficiency.py --quick: real runs on the simulated fleet, sane figures out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import tuning_efficiency as bench

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench") / "tuning_efficiency"
    command = [sys.executable, "bench/tuning_efficiency.py", "--quick", "--budget", "4"]
    subprocess.run([*command, "--out", str(out)], cwd=REPO, check=True, timeout=600)
    return json.loads(out.with_suffix(".json").read_text()), out


def test_quick_mode_runs_every_arm_on_real_training(quick: tuple[dict, Path]) -> None:
    results, _ = quick
    rows = {row["arm"]: row for row in results["runs"]}
    assert set(rows) == {
        "naive",
        "retry-halving",
        "vramtune",
        "vramtune-lease-late",
        "vramtune-plan-on-clock",
    }
    for row in rows.values():
        assert row["completed"] > 0
        assert 0.0 < row["best"] <= 1.0  # digits accuracy
        assert row["compute_s"] <= 3 * 4.0 + 1e-6  # three cards, a 4 s budget each
    assert rows["vramtune"]["oom_crashes"] == 0
    # quick mode's seed asks first for a configuration the 16 MiB card (the first to ask)
    # cannot hold: both naive arms die on it, vramtune plans it elsewhere
    assert rows["naive"]["oom_crashes"] > 0
    assert rows["retry-halving"]["oom_crashes"] > 0
    assert rows["naive"]["time_to_naive_best_s"] is not None
    assert results["meta"]["real_runs"]["digits-cnn"]["executed"] > 0
    # --plan-ahead: a card waits for its first plan choice, later ones overlap its runs
    assert 0 < rows["vramtune"]["planning_s"] <= rows["vramtune"]["planning_total_s"]
    # without it every plan choice is on the card's clock
    on_clock = rows["vramtune-plan-on-clock"]
    assert on_clock["planning_s"] == pytest.approx(on_clock["planning_total_s"])
    # only --plan-ahead hands trials back in the background (while the card trains)
    assert on_clock["handed_back_ahead"] == 0
    assert rows["vramtune"]["handed_back_ahead"] >= 0
    # every run is logged with its trial's parameters, for the decomposition
    assert len(rows["naive"]["attempts"]) == rows["naive"]["runs"]
    assert all(attempt[8] for attempt in rows["vramtune"]["attempts"])


def test_quick_mode_writes_the_plot_and_the_targets(quick: tuple[dict, Path]) -> None:
    _, out = quick
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = out.with_suffix(".md").read_text()
    assert "load average before" in report
    assert "0 OOM crashes: met" in report
    assert "Spread of the time ratio" in report
    assert "with them removed and nothing else changed" in report


def _row(arm: str, reached: float | None, attempts: list[list], waits: list | None = None) -> dict:
    return {
        "task": "t",
        "seed": 0,
        "arm": arm,
        "budget_s": 10.0,
        "direction": "maximize",
        "fleet": ["a", "b"],
        "time_to_naive_best_s": reached,
        "attempts": attempts,
        "hand_back_waits": waits or [],
        "best": max((a[6] for a in attempts if a[6] is not None), default=None),
    }


def test_decompose_splits_the_card_seconds_until_naive_best_by_kind() -> None:
    # naive: an OOM (1 s) on card a, then the best run on card b ending at 3 s
    naive = _row(
        "naive",
        3.0,
        [
            [0, "a", 0.0, 1.0, "OOM", "as asked", None, 0.0, "big", 0.0],
            [1, "b", 0.0, 3.0, "COMPLETE", "as asked", 0.9, 0.0, "small", 0.0],
            [2, "a", 1.0, 5.0, "COMPLETE", "as asked", 0.5, 0.0, "other", 1.0],
        ],
    )
    # vramtune: 0.5 s planning then the big one resized (to 4 s); the reaching trial, leased at
    # 0, runs on card b from 1 s to 5 s
    ours = _row(
        "vramtune",
        5.0,
        [
            [0, "a", 0.0, 4.0, "COMPLETE", "micro-batch 8 x 2 accumulation", 0.8, 0.5, "big", 0.0],
            [1, "b", 1.0, 5.0, "COMPLETE", "as asked", 0.9, 0.0, "small", 0.0],
            [2, "a", 4.0, 6.0, "COMPLETE", "as asked", 0.95, 0.0, "new", 0.0],
        ],
        waits=[[9.0, 1.0]],  # after the horizon: not counted
    )
    theirs = bench.decompose(naive, ours, 0.9)
    assert theirs["card_s"] == pytest.approx(6.0)  # two cards x 3 s
    assert theirs["oom"] == pytest.approx(1.0)
    assert theirs["as_asked"] == pytest.approx(3.0 + 2.0)  # the third run clipped at 3 s
    assert theirs["new"] == pytest.approx(2.0)  # "other": vramtune never ran it
    assert theirs["reaching_trial"] == 1
    assert theirs["reaching_trial_held_s"] == 0.0
    mine = bench.decompose(ours, naive, 0.9)
    assert mine["card_s"] == pytest.approx(10.0)
    assert (mine["planning"], mine["resized"]) == (pytest.approx(0.5), pytest.approx(3.5))
    assert mine["as_asked"] == pytest.approx(4.0 + 1.0)  # card b idle until 1 s
    assert mine["hand_back"] == 0.0
    assert mine["new"] == pytest.approx(1.0)
    assert mine["reaching_trial"] == 1
    assert mine["reaching_trial_held_s"] == pytest.approx(1.0)  # leased at 0, ran from 1 s
