"""`vramtune demo` end to end: server, two simulated-card CPU workers, a study, clean exit."""

from __future__ import annotations

from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

from service.cli.demo import DEFAULT_STUDY
from service.testing import run_vramtune
from service.wire import StudyCreate

ROOT = Path(__file__).resolve().parents[2]


def test_default_demo_study_is_a_valid_study_file() -> None:
    spec = StudyCreate.model_validate(yaml.safe_load(DEFAULT_STUDY.read_text()))
    assert spec.task == "char-transformer"


def test_demo_runs_a_bounded_study_and_keeps_it(tmp_path: Path) -> None:
    database = tmp_path / "demo.db"
    # The digits MLP trains in seconds on a CPU; the default char-transformer study is the
    # same code path with slower trials.
    result = run_vramtune(
        "demo",
        "--study",
        str(ROOT / "examples" / "digits-mlp.yaml"),
        "--trials",
        "3",
        "--exit-when-done",
        "--port",
        "0",
        "--database",
        str(database),
        "--log-dir",
        str(tmp_path / "logs"),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dashboard: http://127.0.0.1:" in result.stdout
    assert "trials 3/3 complete" in result.stdout

    study = optuna.load_study(study_name="digits-mlp-demo", storage=f"sqlite:///{database}")
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) >= 3
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    assert study.best_value > 0.1  # accuracy above chance
