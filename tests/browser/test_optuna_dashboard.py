"""The database vramtune writes stays readable by `optuna-dashboard URL` (0.21)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.testing import free_port
from tests.browser.conftest import N_TRIALS, PATIENCE_S, STUDY, Live

OPTUNA_DASHBOARD = Path(sys.executable).with_name("optuna-dashboard")


def test_optuna_dashboard_reads_a_vramtune_database(live: Live) -> None:
    if not OPTUNA_DASHBOARD.exists():
        pytest.skip("optuna-dashboard is not installed in this environment")
    port = free_port()
    command = [str(OPTUNA_DASHBOARD), live.database_url, "--host", "127.0.0.1", "--port", str(port)]
    log = live.directory / "optuna-dashboard.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        studies = _studies(base, process, log)
        ours = next(s for s in studies if s["study_name"] == STUDY)
        detail = httpx.get(f"{base}/api/studies/{ours['study_id']}?after=0", timeout=60).json()
        assert len(detail["trials"]) == N_TRIALS
        assert {t["state"] for t in detail["trials"]} <= {"Complete", "Pruned", "Fail"}
        assert httpx.get(f"{base}/dashboard", timeout=30).status_code == 200
    finally:
        process.terminate()
        process.wait(20)


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
