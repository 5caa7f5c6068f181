"""Fault and load helpers: a fleet of real worker processes, a TCP proxy we can cut, and a
reader of what the database holds at the end.

Workers are real `vramtune worker` processes (`python -m worker.cli worker`) running only the
quadratic task: such a process starts in ~0.5 s of CPU and ~35 MB, so 32 of them fit on 2 cores.
Everything runs on loopback; waits are failure bounds, never assertions on time.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial
from sqlalchemy import create_engine, func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from vramtune.service.db.tables import LeaseRow, StudyRow, TrialRow
from vramtune.service.wire import API_PREFIX

REPO = Path(__file__).resolve().parents[2]
PATIENCE_S = 150.0  # a failure bound for what takes seconds; never an assertion on time
# Short periods, so that a killed worker's lease is reaped in seconds. A lease must still
# outlive a stalled heartbeat on a loaded 2-core machine: with a 4 s lease and heartbeats every
# 0.5 s (64 a second from 32 workers), a third of the leases of a 32-worker run expired under
# load and their trials ran twice.
FAST_FLEET = {
    "lease_ttl_s": 10.0,
    "heartbeat_interval_s": 1.0,
    "reaper_interval_s": 0.5,
    "worker_stale_s": 10.0,
}
# A worker exits when it has had no work for this long: only a net for a test that dies
# without its teardown. A shorter one ended workers while re-offered trials were still to come.
IDLE_EXIT_S = "600"


# ---------------------------------------------------------------- workers


@dataclass
class WorkerProcess:
    """One `vramtune worker` subprocess with its log file."""

    name: str
    log_path: Path
    process: subprocess.Popen[bytes]

    def alive(self) -> bool:
        """Whether it is still running."""
        return self.process.poll() is None

    def events(self) -> list[dict[str, Any]]:
        """The events of its JSON log lines (vramtune.common.logs): registered, leased, completed,
        ..."""
        return json_events(self.log_path)

    def worker_id(self) -> int:
        """The id the server gave it (from its "registered" event)."""
        return int(next(e["worker_id"] for e in self.events() if e["event"] == "registered"))

    def logs(self) -> str:
        """Everything it wrote."""
        return self.log_path.read_text(errors="replace")

    def wait_for_event(self, name: str, timeout_s: float = PATIENCE_S) -> dict[str, Any]:
        """The first event of that name it logs; fails if it exits or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [e for e in self.events() if e["event"] == name]
            if found:
                return found[0]
            if not self.alive() or time.monotonic() > deadline:
                pytest.fail(f"{self.name} never logged {name!r}:\n{self.logs()[-4000:]}")
            time.sleep(0.05)


class Fleet:
    """Starts worker processes, kills them, and gathers what they logged."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.workers: list[WorkerProcess] = []

    def start(self, server: str, count: int, *options: str) -> list[WorkerProcess]:
        """``count`` workers on a server, each a simulated 1 GiB card running the quadratic task."""
        return [self.start_one(server, *options) for _ in range(count)]

    def start_one(self, server: str, *options: str, name: str | None = None) -> WorkerProcess:
        """One worker; its name is ``rel-<index>-<random>`` unless given."""
        name = name or f"rel-{len(self.workers)}-{uuid.uuid4().hex[:4]}"
        command = [sys.executable, "-m", "vramtune.worker.cli", "worker", "--server", server]
        # An idle worker asks for work twice a second: 32 asking 5 times a second slowed the
        # server enough for heartbeats to miss their leases.
        command += ["--device", "cpu", "--memory-limit", "1GiB", "--poll", "0.5", "--name", name]
        command += ["--tasks", "vramtune.worker.tasks.quadratic", "--no-entry-points"]
        command += ["--log-format", "json", "--exit-when-idle", IDLE_EXIT_S, *options]
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "VRAMTUNE_LOG_LEVEL": "INFO"},
            )
        self.workers.append(WorkerProcess(name, log_path, process))
        return self.workers[-1]

    def busy(self) -> dict[str, dict[str, Any]]:
        """The live workers running a trial now (their last event is "started"): that event by
        worker name."""
        last = {w.name: (w.events() or [{"event": None}])[-1] for w in self.workers if w.alive()}
        return {name: e for name, e in last.items() if e["event"] == "started"}

    def wait_for_busy(self, count: int, timeout_s: float = PATIENCE_S) -> dict[str, dict[str, Any]]:
        """Wait until at least ``count`` workers are running a trial; `busy()` then."""
        deadline = time.monotonic() + timeout_s
        while len(busy := self.busy()) < count:
            if time.monotonic() > deadline:
                pytest.fail(f"fewer than {count} workers ran a trial for {timeout_s:.0f} s")
            time.sleep(0.05)
        return busy

    def kill_busy(
        self, rng: random.Random, timeout_s: float = PATIENCE_S
    ) -> tuple[WorkerProcess, int]:
        """SIGKILL a random live worker that is running a trial (waiting for one to be); the
        worker and the trial it had started."""
        busy = self.wait_for_busy(1, timeout_s)
        name = rng.choice(sorted(busy))
        victim = next(w for w in self.workers if w.name == name)
        victim.process.kill()
        victim.process.wait()
        return victim, int(busy[name]["trial_id"])

    def events(self) -> list[dict[str, Any]]:
        """Every worker's events (stop_all first: a live worker may not have logged its last)."""
        return [event for worker in self.workers for event in worker.events()]

    def stop_all(self) -> dict[str, int]:
        """SIGTERM every live worker and wait for it; exit code by name (-9 for those killed).

        The server commits a call before the worker hears the answer and logs it: read the
        events after this, never as soon as the database shows the study done.
        """
        for worker in self.workers:
            if worker.alive():
                worker.process.send_signal(signal.SIGTERM)
        codes = {}
        for worker in self.workers:
            try:
                codes[worker.name] = worker.process.wait(30)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                codes[worker.name] = worker.process.wait()
        return codes


def json_events(path: Path) -> list[dict[str, Any]]:
    """The events (objects with an "event" key) of a log of JSON lines (``--log-format json``)."""
    found = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by SIGKILL
            continue
        if isinstance(record, dict) and "event" in record:
            found.append(record)
    return found


# ---------------------------------------------------------------- a TCP proxy we can cut


class TcpProxy:
    """Forwards a loopback port to a target; ``cut()`` drops every connection and refuses new
    ones (a database that became unreachable), ``restore()`` forwards again."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.open = threading.Event()
        self.open.set()
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True).start()

    def cut(self) -> None:
        """Refuse new connections and reset the ones that exist."""
        self.open.clear()
        with self._lock:
            for sock in self._sockets:
                _close(sock)
            self._sockets.clear()

    def restore(self) -> None:
        """Forward again."""
        self.open.set()

    def close(self) -> None:
        """Stop listening and drop everything."""
        self.closed.set()
        self.cut()
        _close(self.listener)

    def _accept_loop(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                _close(client)  # the database "is not there"
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                _close(sock)
            with self._lock:
                self._sockets -= {source, sink}


def _close(sock: socket.socket) -> None:
    """Reset a socket, ignoring one already closed.

    shutdown() first: close() alone does not end a socket another thread is blocked reading,
    so neither end would hear of it (the database "outage" then looks like a hung connection).
    """
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


# ---------------------------------------------------------------- studies and the outcome


def quadratic_study(
    name: str, n_trials: int, step_seconds: float = 0.01, reports: bool = True
) -> dict[str, Any]:
    """A quadratic study of ``n_trials`` short trials (20 steps, two intermediate reports)."""
    return {
        "name": name,
        "task": "quadratic",
        "search_space": {
            "x": {"type": "float", "low": -3, "high": 3},
            "y": {"type": "float", "low": -3, "high": 3},
        },
        "sampler": {"name": "random", "args": {"seed": 7}},
        "pruner": {"name": "none"},
        "n_trials": n_trials,
        "budget": {"max_steps": 20, "eval_every": 10 if reports else 1000},
        "task_config": {"step_seconds": step_seconds},
    }


def create_study(
    server_url: str, n_trials: int, step_seconds: float = 0.01, reports: bool = True
) -> str:
    """Create a quadratic study over REST; its name."""
    name = f"rel-{uuid.uuid4().hex[:8]}"
    body = quadratic_study(name, n_trials, step_seconds, reports)
    response = httpx.post(f"{server_url}{API_PREFIX}/studies", json=body, timeout=60)
    assert response.status_code == 201, response.text
    return name


@dataclass
class Outcome:
    """What the database holds about one study: Optuna's trials and vramtune's rows."""

    trials: list[FrozenTrial]
    rows: dict[int, TrialRow]
    leases: dict[int, list[LeaseRow]] = field(default_factory=dict)

    def states(self) -> dict[str, int]:
        """Trials by TrialState name."""
        counted: dict[str, int] = {}
        for trial in self.trials:
            counted[trial.state.name] = counted.get(trial.state.name, 0) + 1
        return counted

    def row_statuses(self) -> dict[str, int]:
        """vramtune's rows by status (leased, pending, waiting, done)."""
        counted: dict[str, int] = {}
        for row in self.rows.values():
            counted[row.status] = counted.get(row.status, 0) + 1
        return counted

    def finished(self) -> int:
        """Trials COMPLETE, FAIL or PRUNED."""
        return sum(1 for t in self.trials if t.state.is_finished())

    def active_leases(self) -> list[LeaseRow]:
        """Leases still active."""
        return [lease for leases in self.leases.values() for lease in leases if lease.active]


def read_outcome(url: str, study: str) -> Outcome:
    """Read the study's trials (Optuna), trial rows and leases (vramtune) straight from the DB."""
    storage = RDBStorage(url, skip_table_creation=True, skip_compatibility_check=True)
    engine = create_engine(url)
    try:
        study_id = storage.get_study_id_from_name(study)
        trials = storage.get_all_trials(study_id)
        with Session(engine) as session:
            assert session.scalar(select(StudyRow).where(StudyRow.name == study)) is not None
            rows = {
                r.trial_id: r
                for r in session.scalars(select(TrialRow).where(TrialRow.study_id == study_id))
            }
            leases: dict[int, list[LeaseRow]] = {}
            query = select(LeaseRow).where(LeaseRow.trial_id.in_(rows)).order_by(LeaseRow.id)
            for lease in session.scalars(query):
                leases.setdefault(lease.trial_id, []).append(lease)
            session.expunge_all()
    finally:
        storage.engine.dispose()
        engine.dispose()
    return Outcome(trials, rows, leases)


def poll_outcome(
    url: str, study: str, done: Callable[[Outcome], bool], timeout_s: float = PATIENCE_S
) -> Outcome:
    """Read the outcome until ``done(outcome)``; fail with the trial states after ``timeout_s``.

    A read that fails to connect is retried: the database may be full of other tests' clients.
    """
    deadline = time.monotonic() + timeout_s
    outcome = None
    while True:
        try:
            outcome = read_outcome(url, study)
        except OperationalError as error:
            print(f"outcome unreadable for now: {error}")
        else:
            if done(outcome):
                return outcome
        if time.monotonic() > deadline:
            states = None if outcome is None else (outcome.states(), outcome.row_statuses())
            pytest.fail(f"study {study} not there after {timeout_s:.0f} s: {states}")
        time.sleep(0.4)


def wait_for_budget(url: str, study: str, n_trials: int) -> Outcome:
    """Poll until vramtune holds the whole budget as done and Optuna has finished those trials.

    Optuna is told first and vramtune's rows commit just after: wait for both. An Optuna trial
    without a vramtune row does not hold the wait up; assert_accounted names it.
    """

    def settled(outcome: Outcome) -> bool:
        known = [t for t in outcome.trials if t._trial_id in outcome.rows]
        return (
            len(outcome.rows) >= n_trials
            and all(row.status == "done" for row in outcome.rows.values())
            and all(t.state.is_finished() for t in known)
        )

    return poll_outcome(url, study, settled)


def wait_for_finished(url: str, study: str, count: int) -> Outcome:
    """Poll until at least ``count`` trials of the study are finished."""
    return poll_outcome(url, study, lambda o: o.finished() >= count)


def assert_accounted(outcome: Outcome, n_trials: int) -> None:
    """The budget exactly, every trial COMPLETE or FAIL with a reason, numbers told once, no
    trial held by two leases at once, and no lease left active."""
    orphans = [(t.number, t.state.name) for t in outcome.trials if t._trial_id not in outcome.rows]
    # An ask Optuna committed whose vramtune transaction was lost (server killed, database gone)
    assert orphans == [], f"Optuna trials (number, state) {orphans} have no vramtune row"
    assert len(outcome.trials) == n_trials, f"{len(outcome.trials)} trials for {n_trials}"
    assert sorted(t.number for t in outcome.trials) == list(range(n_trials))
    states = outcome.states()
    assert set(states) <= {"COMPLETE", "FAIL"}, states
    for trial in outcome.trials:
        row = outcome.rows[trial._trial_id]
        assert row.status == "done", (trial.number, row.status)
        if trial.state.name == "FAIL":
            assert row.message, f"trial {trial.number} FAILED without a reason"
        else:
            assert trial.values is not None and len(trial.values) == 1
    assert outcome.active_leases() == []
    for trial_id, leases in outcome.leases.items():
        assert_one_holder(trial_id, leases)


# How a lease ends when its worker lost the trial rather than finished it.
LOST = {("reaper", None), ("stop", None), ("fail", "interrupted")}


def assert_one_holder(trial_id: int, leases: list[LeaseRow]) -> None:
    """A trial's leases follow one another: every one but the last was lost (reaped, worker
    stopped or interrupted), and the trial was ended under one lease only."""
    ordered = sorted(leases, key=lambda lease: lease.id)
    ends = [
        ((lease.resolution or {}).get("call"), (lease.resolution or {}).get("kind"))
        for lease in ordered
    ]
    assert all(end in LOST for end in ends[:-1]), f"trial {trial_id}: leases ended {ends}"


class LeaseAuditor:
    """Polls the database while a test runs for a trial with two active leases at once."""

    def __init__(self, url: str, period_s: float = 0.25) -> None:
        self.engine = create_engine(url, pool_size=1, max_overflow=0)
        self.period_s = period_s
        self.doubles: list[tuple[int, int]] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lease-auditor", daemon=True)

    def __enter__(self) -> LeaseAuditor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.engine.dispose()

    def _loop(self) -> None:
        query = (
            select(LeaseRow.trial_id, func.count())
            .where(LeaseRow.active.is_(True))
            .group_by(LeaseRow.trial_id)
            .having(func.count() > 1)
        )
        while not self._stop.wait(self.period_s):
            try:
                with self.engine.connect() as connection:
                    self.doubles += [(int(t), int(n)) for t, n in connection.execute(query)]
                self.polls += 1
            except OperationalError:  # the database may be away on purpose
                continue


def completed_by_workers(events: list[dict[str, Any]]) -> dict[int, int]:
    """How many times workers logged a trial completed and acknowledged as complete."""
    counts: dict[int, int] = {}
    for event in events:
        if event.get("event") == "completed" and event.get("resolution") == "complete":
            counts[event["trial_id"]] = counts.get(event["trial_id"], 0) + 1
    return counts
