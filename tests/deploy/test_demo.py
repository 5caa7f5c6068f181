"""`vramtune demo` end to end: server, two simulated-card CPU workers, a study, clean exit.

The default demo (the char-transformer study, six trials) must show what the memory policy
does: trials resized to fit, handed back by the small card and routed to the large one, and
ended as infeasible when no card holds them, each plan choice's time on the trial record.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

from service.cli.demo import DEFAULT_STUDY, progress_line
from service.testing import run_vramtune
from service.wire import StudyCreate, StudySummary, TrialOut

ROOT = Path(__file__).resolve().parents[2]


def test_default_demo_study_is_a_valid_study_file() -> None:
    spec = StudyCreate.model_validate(yaml.safe_load(DEFAULT_STUDY.read_text()))
    assert spec.task == "char-transformer"
    assert spec.sampler.args.get("seed") is not None  # the demo's trials are the same each run


def test_the_progress_line_counts_outcomes_and_the_plan_choice_median() -> None:
    spec = StudyCreate.model_validate(yaml.safe_load(DEFAULT_STUDY.read_text()))
    summary = StudySummary(
        id=1,
        name=spec.name,
        task=spec.task,
        state="running",
        directions=["minimize"],
        n_trials=6,
        counts={"COMPLETE": 2, "RUNNING": 1},
        created_at="2026-12-04T00:00:00Z",
        spec=spec,
    )
    trials = [
        TrialOut(id=i, number=i, state="COMPLETE", params={}, outcome=outcome, planning_s=took)
        for i, (outcome, took) in enumerate(
            [("resized", 0.5), ("routed", 1.5), ("infeasible", 2.5), (None, None)]
        )
    ]
    line = progress_line(summary, trials)
    assert "trials 2/6 complete, 1 running" in line
    assert "resized 1, routed 1, infeasible 1, oom 0" in line
    assert "plan choice median 1.50 s" in line


def _demo(tmp_path: Path, study_name: str, *args: str) -> optuna.Study:
    """Run `vramtune demo ARGS` to its end; the study it kept."""
    database = tmp_path / "demo.db"
    result = run_vramtune(
        "demo",
        *args,
        "--exit-when-done",
        "--port",
        "0",
        "--database",
        str(database),
        "--log-dir",
        str(tmp_path / "logs"),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dashboard: http://127.0.0.1:" in result.stdout
    study = optuna.load_study(study_name=study_name, storage=f"sqlite:///{database}")
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    return study


def test_the_default_demo_resizes_routes_and_ends_infeasible_trials(tmp_path: Path) -> None:
    study = _demo(tmp_path, "char-transformer-demo", "--trials", "6")
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) >= 6
    outcomes = Counter(t.user_attrs.get("vramtune.outcome") for t in finished)
    assert outcomes["resized"] >= 1, outcomes
    assert outcomes["routed"] >= 1, outcomes
    assert outcomes["infeasible"] >= 1, outcomes
    for trial in finished:  # every trial was planned on a card, and how long that took is kept
        assert trial.user_attrs.get("vramtune.planning_s", 0) > 0, trial.user_attrs


def test_a_demo_of_another_study_file_runs_it_and_keeps_it(tmp_path: Path) -> None:
    digits = str(ROOT / "examples" / "digits-mlp.yaml")
    study = _demo(tmp_path, "digits-mlp-demo", "--study", digits, "--trials", "3")
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) >= 3
    assert study.best_value > 0.1  # accuracy above chance


def test_the_readmes_own_code_demo_runs_the_users_task_file(tmp_path: Path) -> None:
    """README, "Your own code, in one command": a user's task file and its study, as written."""
    study_file, task_file = (
        str(ROOT / "examples" / n) for n in ("plain_task.yaml", "plain_task.py")
    )
    study = _demo(
        tmp_path, "plain-digits", "--study", study_file, "--tasks", task_file, "--trials", "3"
    )
    finished = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(finished) >= 3, [t.state for t in study.trials]
    assert study.best_value < 2.5  # a held-out loss: ten classes' chance is ln 10 = 2.3
