"""bench/tuning_efficiency.py --quick: real runs on the simulated fleet, sane figures out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert set(rows) == {"naive", "retry-halving", "vramtune", "vramtune-plan-on-clock"}
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


def test_quick_mode_writes_the_plot_and_the_targets(quick: tuple[dict, Path]) -> None:
    _, out = quick
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = out.with_suffix(".md").read_text()
    assert "load average before" in report
    assert "0 OOM crashes: met" in report
