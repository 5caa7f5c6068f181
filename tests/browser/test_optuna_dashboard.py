"""The database vramtune writes stays readable by `optuna-dashboard URL` (0.21), and
optuna-dashboard never calls an infeasible trial (a placeholder: no card could hold it) best.

optuna-dashboard ranks COMPLETE trials by value alone (its single-objective "Best Trial" is
`RDBStorage.get_best_trial`, its Pareto front ignores constraints): vramtune's placeholder
values are what keep infeasible trials out (vramtune.service.fleet.routing).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest

from tests.browser.conftest import MO_STUDY, N_TRIALS, PATIENCE_S, STUDY, Live
from vramtune.service.testing import free_port

OPTUNA_DASHBOARD = Path(sys.executable).with_name("optuna-dashboard")
WAIT_MS = PATIENCE_S * 1000


@dataclass(frozen=True)
class OptunaDashboard:
    """`optuna-dashboard URL` running on the live server's database."""

    base: str
    studies: dict[str, int]  # study name -> optuna-dashboard's study id

    def detail(self, name: str) -> dict[str, Any]:
        """GET /api/studies/<id>: the study's trials and its best trials as it computes them."""
        url = f"{self.base}/api/studies/{self.studies[name]}?after=0"
        found: dict[str, Any] = httpx.get(url, timeout=60).json()
        return found


@pytest.fixture(scope="module")
def optuna_dashboard(live: Live) -> Iterator[OptunaDashboard]:
    """optuna-dashboard on the live database, once it answers; stopped after the module."""
    if not OPTUNA_DASHBOARD.exists():
        pytest.skip("optuna-dashboard is not installed in this environment")
    port = free_port()
    command = [str(OPTUNA_DASHBOARD), live.database_url, "--host", "127.0.0.1", "--port", str(port)]
    log = live.directory / "optuna-dashboard.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        summaries = _studies(base, process, log)
        ids = {str(s["study_name"]): int(str(s["study_id"])) for s in summaries}
        yield OptunaDashboard(base, ids)
    finally:
        process.terminate()
        process.wait(20)


def test_optuna_dashboard_reads_a_vramtune_database(optuna_dashboard: OptunaDashboard) -> None:
    detail = optuna_dashboard.detail(STUDY)
    assert len(detail["trials"]) == N_TRIALS
    assert {t["state"] for t in detail["trials"]} <= {"Complete", "Pruned", "Fail"}
    assert httpx.get(f"{optuna_dashboard.base}/dashboard", timeout=30).status_code == 200


@pytest.mark.parametrize("name", [STUDY, MO_STUDY])
def test_optuna_dashboard_calls_no_infeasible_trial_best(
    optuna_dashboard: OptunaDashboard, live: Live, name: str
) -> None:
    infeasible = infeasible_numbers(live, name)
    assert infeasible, "the study has no infeasible trial: this test would prove nothing"
    best = {t["number"] for t in optuna_dashboard.detail(name)["best_trials"]}
    assert best, "optuna-dashboard shows no best trial"
    assert not best & infeasible, f"infeasible trials {best & infeasible} called best"
    study = optuna.load_study(study_name=name, storage=live.database_url)
    assert best == {t.number for t in study.best_trials}  # as Optuna itself, feasibility aware


def test_optuna_dashboards_best_trial_card_names_a_feasible_trial(
    optuna_dashboard: OptunaDashboard, live: Live, browser: Any
) -> None:
    page = browser.new_page()
    try:
        page.goto(f"{optuna_dashboard.base}/dashboard/studies/{optuna_dashboard.studies[STUDY]}")
        card = page.get_by_text(re.compile(r"Best Trial \(number=\d+\)")).first
        card.wait_for(timeout=WAIT_MS)
        shown = re.search(r"number=(\d+)", card.inner_text())
        assert shown is not None
        study = optuna.load_study(study_name=STUDY, storage=live.database_url)
        assert int(shown.group(1)) == study.best_trial.number
        assert int(shown.group(1)) not in infeasible_numbers(live, STUDY)
    finally:
        page.close()


def infeasible_numbers(live: Live, name: str) -> set[int]:
    """The study's COMPLETE trials with a violated constraint (placeholder values)."""
    study = optuna.load_study(study_name=name, storage=live.database_url)
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    return {t.number for t in complete if any(v > 0 for v in t.constraints.values())}


def _studies(base: str, process: subprocess.Popen[bytes], log: Path) -> list[dict[str, object]]:
    """optuna-dashboard's list of studies, once it answers."""
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"optuna-dashboard exited:\n{log.read_text(errors='replace')}")
        try:
            response = httpx.get(f"{base}/api/studies", timeout=10)
            if response.status_code == 200:
                summaries: list[dict[str, object]] = response.json()["study_summaries"]
                return summaries
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    pytest.fail("optuna-dashboard did not answer")
