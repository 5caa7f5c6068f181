"""End-to-end fixtures: one real server per database kind, real `vramtune worker` processes.

Servers are shared by the session's tests (starting uvicorn and importing Optuna costs seconds);
each test creates its own study and deletes it at the end, so no test's workers see another's
trials. Leases, heartbeats and the reaper run on short periods so that crashes are noticed fast.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest
import sqlalchemy as sa

from vramtune.service.client import Client
from vramtune.service.testing import (
    ServerFactory,
    ServerProcess,
    fresh_postgres_database,
    server_factory,
    sqlite_url,
    upgrade_database,
)
from vramtune.service.wire import StudySummary, TrialOut

REPO = Path(__file__).resolve().parents[2]
# Short periods: a dead worker loses its lease in about four seconds (not less: on a loaded
# 2-core machine a request can take seconds, and a lease must outlive the call that made it).
FAST_FLEET = {
    "lease_ttl_s": 4.0,
    "heartbeat_interval_s": 0.5,
    "reaper_interval_s": 0.3,
    "worker_stale_s": 4.0,
}
# What a test waits at most for something that should take a few seconds; a failure bound, not
# an assertion on time.
PATIENCE_S = 90.0
SMALL = "64MiB"
LARGE = "256MiB"


class WorkerProcess:
    """`python -m vramtune worker --device cpu --memory-limit SIZE` as a real subprocess."""

    def __init__(self, server: str, memory_limit: str, log_path: Path, *options: str) -> None:
        self.log_path = log_path
        command = [sys.executable, "-m", "vramtune", "worker", "--server", server]
        command += ["--device", "cpu", "--memory-limit", memory_limit, "--poll", "0.1"]
        # Only the quadratic task: a worker that loads no torch task starts in a second.
        command += ["--tasks", "vramtune.worker.tasks.quadratic", "--no-entry-points"]
        command += ["--name", log_path.stem, *options]
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    @property
    def name(self) -> str:
        """The worker's name, as the server shows it."""
        return self.log_path.stem

    def logs(self) -> str:
        """Everything the worker wrote so far."""
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = PATIENCE_S) -> int:
        """Its exit code, once it exits."""
        return self.process.wait(timeout)

    def signal(self, signum: int) -> None:
        """Send a signal (SIGTERM, SIGKILL...)."""
        self.process.send_signal(signum)

    def wait_for(self, text: str, timeout: float = PATIENCE_S) -> None:
        """Until the worker has logged `text`; fails with its log after `timeout`."""
        deadline = time.monotonic() + timeout
        while text not in self.logs():
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{self.name} never logged {text!r}:\n{self.logs()[-4000:]}")
            time.sleep(0.1)

    def finish(self) -> int:
        """SIGTERM once its work is done: the exit code of a clean shutdown."""
        self.process.send_signal(signal.SIGTERM)
        return self.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


WorkerFactory = Callable[..., WorkerProcess]


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[WorkerFactory]:
    """start_worker(server, memory_limit=SMALL, *options) -> WorkerProcess; stopped after."""
    workers: list[WorkerProcess] = []

    def start(server: str, memory_limit: str = SMALL, *options: str) -> WorkerProcess:
        log_path = tmp_path / f"worker-{len(workers)}-{uuid.uuid4().hex[:4]}.log"
        worker = WorkerProcess(server, memory_limit, log_path, *options)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()
        print(f"----- {worker.log_path.name}\n{worker.logs()[-8000:]}")


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def fleet_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A migrated database (SQLite or PostgreSQL) and a server on it with short lease periods."""
    directory = tmp_path_factory.mktemp(f"fleet-{request.param}")
    with ExitStack() as stack:
        if request.param == "sqlite":
            url = sqlite_url(directory)
        else:
            url = stack.enter_context(fresh_postgres_database())
        upgrade_database(url)
        start = stack.enter_context(server_factory(directory))
        yield start(url, **FAST_FLEET)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[ServerFactory]:
    """start_server for a test that needs servers of its own (the two-replica test)."""
    with server_factory(tmp_path) as start:
        yield start


class Studies:
    """Creates studies with unique names on a server and deletes them afterwards."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.names: list[str] = []

    def create(self, search_space: dict[str, Any], **spec: Any) -> str:
        """A quadratic study; `spec` overrides the defaults (n_trials, task_config, ...)."""
        name = f"e2e-{uuid.uuid4().hex[:10]}"
        body: dict[str, Any] = {
            "name": name,
            "task": "quadratic",
            "search_space": search_space,
            "sampler": {"name": "random", "args": {"seed": 1}},
            "pruner": {"name": "none"},
            "n_trials": 1,
            "budget": {"max_steps": 10, "eval_every": 5},
            "task_config": {"step_seconds": 0.001},
        }
        self.client.create_study(body | spec)
        self.names.append(name)
        return name

    def trials(self, name: str) -> list[TrialOut]:
        """Every trial of the study, in number order."""
        return list(self.client.trials(name, limit=1000).trials)

    def summary(self, name: str) -> StudySummary:
        """The study's summary (counts per state)."""
        return self.client.get_study(name)

    def wait_until(
        self, name: str, done: Callable[[list[TrialOut]], bool], timeout: float = PATIENCE_S
    ) -> list[TrialOut]:
        """Poll the study's trials until `done(trials)`; fails with the trials after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            trials = self.trials(name)
            if done(trials):
                return trials
            if time.monotonic() > deadline:
                pytest.fail(f"study {name} never got there: {[_brief(t) for t in trials]}")
            time.sleep(0.1)

    def cleanup(self) -> None:
        """Delete every study this test created, so later tests' workers find nothing of it."""
        for name in self.names:
            try:
                self.client.delete(name)
            except Exception as error:  # a test that deleted its study itself
                print(f"cleanup of {name}: {error}")


@pytest.fixture
def studies(fleet_server: ServerProcess) -> Iterator[Studies]:
    """Studies on the module's server."""
    with Client(fleet_server.url) as client:
        made = Studies(client)
        yield made
        made.cleanup()


def _brief(trial: TrialOut) -> dict[str, Any]:
    return {
        "number": trial.number,
        "state": trial.state,
        "attempt": trial.attempt,
        "outcome": trial.outcome,
        "worker": trial.worker,
    }


def finished(count: int) -> Callable[[list[TrialOut]], bool]:
    """`count` trials, all finished with vramtune's outcome recorded (it commits with Optuna's
    state; a trial finished through plain Optuna has none)."""
    return lambda trials: (
        len(trials) >= count
        and all(t.state in {"COMPLETE", "FAIL", "PRUNED"} and t.outcome is not None for t in trials)
    )


def tell_non_finite(database_url: str, name: str) -> None:
    """Trials of a study told through plain Optuna, as a user's own objective would tell them:
    +inf (after reporting NaN, +inf, -inf and 0.5), -inf (the best when minimized), NaN (which
    Optuna tells as FAIL) and 1.5."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.load_study(study_name=name, storage=database_url)
    trial = study.ask()
    for step, value in enumerate(REPORTED):
        trial.report(value, step)
    study.tell(trial, math.inf)
    for value in (-math.inf, math.nan, 1.5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The value nan is not acceptable": the FAIL
            study.tell(study.ask(), value)


REPORTED = (math.nan, math.inf, -math.inf, 0.5)  # trial 0's intermediate values, steps 0 to 3


def running_on(worker: WorkerProcess) -> Callable[[list[TrialOut]], bool]:
    """Some trial is running on this worker."""
    return lambda trials: any(t.state == "RUNNING" and t.worker == worker.name for t in trials)


def dashboard_trial(server: ServerProcess, study: str, number: int) -> dict[str, Any]:
    """The dashboard's view of one trial, with its runs (memory observations)."""
    url = f"{server.url}/api/v1/dashboard/studies/{study}/trials/{number}"
    response = httpx.get(url, timeout=30)
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


PEAK_COLUMNS = (
    "predicted_training",
    "predicted_evaluation",
    "measured_training",
    "measured_evaluation",
)


def observed_peaks(database_url: str, trial_id: int) -> dict[str, int | None]:
    """The training-step and evaluation peaks, predicted and measured, of the trial's newest
    stored memory observation (trial ids of deleted studies come back in SQLite: the newest
    is ours)."""
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as connection:
            row = connection.execute(
                sa.text(
                    f"SELECT {', '.join(PEAK_COLUMNS)} FROM vramtune_memory_observations "
                    "WHERE trial_id = :t ORDER BY id DESC"
                ),
                {"t": trial_id},
            ).first()
    finally:
        engine.dispose()
    assert row is not None, f"no memory observation of trial {trial_id}"
    return dict(zip(PEAK_COLUMNS, row, strict=True))
