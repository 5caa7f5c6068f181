"""`vramtune demo` end to end: server, two simulated-card CPU workers, a study, clean exit.

The default demo (the char-transformer study, six trials) must show what the memory policy
does: trials resized to fit, handed back by the small card and routed to the large one, and
ended as infeasible when no card holds them, each plan choice's time on the trial record. A demo
exits by itself (rc 0) once its trials are done; `--keep-serving` keeps it up until Ctrl-C.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import optuna
import yaml
from optuna.trial import TrialState

from vramtune.service.cli.demo import DEFAULT_STUDY, progress_line
from vramtune.service.cli.parser import build_parser
from vramtune.service.testing import run_vramtune
from vramtune.service.wire import StudyCreate, StudySummary, TrialOut

ROOT = Path(__file__).resolve().parents[2]
SHADOWS = {  # a user's own modules under the names vramtune's internals once had
    "common.py": "raise ImportError('the user project common.py was imported')\n",
    "service/__init__.py": "raise ImportError('the user project service/ was imported')\n",
    "worker/__init__.py": "raise ImportError('the user project worker/ was imported')\n",
}


def user_project(folder: Path) -> Path:
    """A user's project folder holding their own `common.py`, `service/` and `worker/`: each
    fails loudly if vramtune ever imports it in place of its own."""
    for name, text in SHADOWS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


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
    now = datetime(2026, 12, 7, 12, 0, 0, tzinfo=UTC)
    line = progress_line(summary, trials, now)
    assert "trials 2/6 complete, 1 running" in line
    assert "resized 1, routed 1, infeasible 1, oom 0" in line
    assert line.endswith("plan choice median 1.50 s | best -")  # nothing is being planned
    planned = trials[-1].model_copy(update={"state": "RUNNING"})
    for leased_s, words in [(3, "planning trial 3"), (12, "planning trial 3: 10 s")]:
        planned.planning_since = now - timedelta(seconds=leased_s)
        line = progress_line(summary, [*trials[:-1], planned], now)
        assert line.endswith(f"best - | {words}")


def _places(tmp_path: Path) -> list[str]:
    """The demo's database, logs and port, inside the test's directory."""
    database, logs = str(tmp_path / "demo.db"), str(tmp_path / "logs")
    return ["--port", "0", "--database", database, "--log-dir", logs]


def _demo(tmp_path: Path, study_name: str, *args: str, cwd: Path | None = None) -> optuna.Study:
    """Run `vramtune demo ARGS` until it exits by itself (no flag asks it to); the study kept."""
    database = tmp_path / "demo.db"
    result = run_vramtune("demo", *args, *_places(tmp_path), timeout=900, cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "study done; the dashboard stays up" not in result.stdout
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
    """README, "Your own code, in one command": a user's task file and its study, as written,
    run from a project folder whose own `common`, `service` and `worker` modules come first on
    `sys.path` (issue 42: they shadowed vramtune's when it installed those names)."""
    study_file, task_file = (
        str(ROOT / "examples" / n) for n in ("plain_task.yaml", "plain_task.py")
    )
    project = user_project(tmp_path / "project")
    study = _demo(
        tmp_path,
        "plain-digits",
        *("--study", study_file, "--tasks", task_file, "--trials", "3"),
        cwd=project,
    )
    finished = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(finished) >= 3, [t.state for t in study.trials]
    assert study.best_value < 2.5  # a held-out loss: ten classes' chance is ln 10 = 2.3


def test_exit_when_done_is_the_default_and_keep_serving_undoes_it() -> None:
    parse = build_parser().parse_args
    assert parse(["demo"]).keep_serving is False
    assert parse(["demo", "--keep-serving"]).keep_serving is True
    assert parse(["demo", "--exit-when-done"]).keep_serving is False  # the old flag still parses
    assert parse(["demo", "--keep-serving", "--exit-when-done"]).keep_serving is False


def test_keep_serving_keeps_the_dashboard_up_after_the_trials_until_ctrl_c(
    tmp_path: Path,
) -> None:
    digits = str(ROOT / "examples" / "digits-mlp.yaml")
    command = [sys.executable, "-m", "vramtune", "demo", "--study", digits, "--trials", "1"]
    demo = subprocess.Popen(
        [*command, "--keep-serving", *_places(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = _lines_until(demo, "study done; the dashboard stays up")
        url = next(line for line in lines if line.startswith("dashboard: ")).split()[1]
        time.sleep(3.0)  # past the next progress poll: a demo that exits would be gone by now
        assert demo.poll() is None
        assert httpx.get(url, timeout=30).status_code == 200
        demo.send_signal(signal.SIGINT)
        assert demo.wait(120) == 0
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def _lines_until(process: subprocess.Popen[str], wanted: str) -> list[str]:
    """The process's output lines up to the first holding `wanted` (fails if it exits first)."""
    assert process.stdout is not None
    lines: list[str] = []
    for line in process.stdout:
        lines.append(line)
        if wanted in line:
            return lines
    raise AssertionError(f"exited with {process.wait()} before {wanted!r}:\n{''.join(lines)}")
