"""Trials per second: raw Optuna vs Optuna's gRPC proxy vs vramtune, side by side.

One cell = (system, database, sampler, pre-filled trials, N workers). Each cell gets a fresh
database, a study pre-filled with COMPLETE trials, N client processes that warm up, wait at a
common start, run for ``--duration`` seconds, finish what they hold and report. Then the cell
checks that every trial of the study is COMPLETE exactly once (contiguous numbers, one tell per
trial, the clients' completed ids equal the study's new trials).

- raw: each process ``optuna.load_study`` on its own cached RDBStorage, ask/tell.
- grpc: one ``run_grpc_proxy_server`` process over the cached RDBStorage, N processes with
  ``GrpcStorageProxy`` (needs ``grpcio`` and ``protobuf``, installed for this benchmark only).
- vramtune: one real ``vramtune serve`` (uvicorn) subprocess; N processes, each a simulated worker
  doing register, then next -> start -> complete over HTTP/1.1 keep-alive.

Paced cells (``--think S``, vramtune only): the simulated workers train between calls instead
of running closed-loop. Each trial trains for a draw from a seeded uniform [0.5 S, 1.5 S]
(``start``, then training, then ``complete+next``); each worker heartbeats its trial every
``--paced-heartbeat`` seconds (5 s, the server's default ``heartbeat_interval_s``; 0 = none) on a
thread and connection of its own, as the worker agent does. Each worker leases and starts its
first trial while warming up and the window opens part-way through that trial's training, so
the window sees a steady fleet, not 256 workers starting together. The offered load is
N / S trials/s; what the service achieved is what completed. A closed loop (``--think 0``, the
default) offers as much as the system absorbs.

Usage: ``python bench/service_throughput.py --preset default`` (the cells of the committed
results), or pick a matrix: ``--systems raw,vramtune --databases postgresql --samplers random
--prefill 0 --workers 1,16 --duration 10``; a paced cell: ``--systems vramtune --workers 256
--think 10 --duration 40``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import optuna
import psutil
import sqlalchemy as sa
from optuna.distributions import BaseDistribution, FloatDistribution
from optuna.storages import RDBStorage
from optuna.storages._cached_storage import _CachedStorage
from optuna.storages._rdb import models

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vramtune.service.db.engine import engine_kwargs, make_engine, make_sessions  # noqa: E402
from vramtune.service.db.migrate import upgrade  # noqa: E402
from vramtune.service.optuna.glue import make_storage  # noqa: E402
from vramtune.service.state import utcnow  # noqa: E402
from vramtune.service.studies import create_study  # noqa: E402
from vramtune.service.wire import API_PREFIX, StudyCreate  # noqa: E402

PG_ADMIN_URL = os.environ.get("BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
PG_HOST = os.environ.get("BENCH_PG_HOST", "postgres@127.0.0.1:5432")
STUDY = "bench"
SPACE: dict[str, BaseDistribution] = {
    "x": FloatDistribution(-10.0, 10.0),
    "y": FloatDistribution(-10.0, 10.0),
}
CARD_BYTES = 80 * 10**9
READY_TIMEOUT_S = [600.0]  # set by --ready-timeout
SLOW_CELL_S = 20.0
HEARTBEAT_CELL_S = 30.0  # six heartbeats per worker
SYSTEMS = ("raw", "grpc", "vramtune", "vramtune2", "heartbeats")
BENCH_LEASE_TTL_S = 600
ANALYSIS_MARK = "<!-- analysis: written by hand, kept when the tables are rewritten -->"
MAX_CLIENT_PROCESSES = 16
MIN_FREE_BYTES = 3 * 2**30  # a cell stops before its clients take the machine's memory

optuna.logging.set_verbosity(optuna.logging.ERROR)


def objective(x: float, y: float) -> float:
    """The trivial objective every system evaluates."""
    return (x - 2.0) ** 2 + (y + 1.0) ** 2


# ---------------------------------------------------------------- cells and results


@dataclass(frozen=True)
class Cell:
    """One measurement: a system on a database with a sampler, a pre-fill and N workers."""

    system: str
    database: str
    sampler: str
    prefill: int
    workers: int
    think: float = 0.0  # mean seconds a worker trains between start and complete (0: closed loop)
    heartbeat: float = 0.0  # seconds between a paced worker's heartbeats (0: none)

    def label(self) -> str:
        """A short name for logs."""
        label = f"{self.system}/{self.database}/{self.sampler}/{self.prefill}/N={self.workers}"
        if self.think:
            label += f"/think={self.think:g}" + (f"+hb{self.heartbeat:g}" if self.heartbeat else "")
        return label


@dataclass
class ClientReport:
    """What one client process did during a cell."""

    calls: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    completed: list[tuple[int, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    empty_nexts: int = 0
    cpu_s: float = 0.0  # the client process's CPU inside the window

    def timed(self, name: str, started: float, wall_started: float) -> None:
        """Record a call that started at perf ``started`` (wall clock ``wall_started``)."""
        self.calls.setdefault(name, []).append((wall_started, time.perf_counter() - started))


@dataclass
class CellResult:
    """The figures of one cell."""

    cell: Cell
    duration_s: float
    trials: int
    trials_per_s: float
    latency_ms: dict[str, dict[str, float]]
    errors: int
    error_samples: list[str]
    check: dict[str, Any]
    server_cpu_s: float | None = None
    server_rss_mib: float | None = None
    # CPU of everything the system ran (clients, server processes, the database's backends)
    # per completed trial: what it costs, whatever share of a shared machine it was given.
    cpu_ms_per_trial: float | None = None
    notes: list[str] = field(default_factory=list)
    repeat: int = 0  # which run of the cell (--repeat)
    # The service's CPU (server processes and database backends, not the simulated workers)
    # in percent of one core over the window: the heartbeat cell's figure.
    service_core_pct: float | None = None
    load: tuple[float, float] | None = None  # 1-minute load average before and after
    # Mean ms per request and per phase of a call inside the server, over the window, from its
    # /metrics (process 1 of the server only when it runs several): "route call" and
    # "phase call/name" (vramtune.service.metrics.PHASE_SECONDS), with their counts.
    phases_ms: dict[str, dict[str, float]] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def latency_summary(
    reports: list[ClientReport], start: float, end: float
) -> dict[str, dict[str, float]]:
    """p50/p99/mean in ms per call name, over calls started inside the window."""
    merged: dict[str, list[float]] = {}
    for report in reports:
        for name, calls in report.calls.items():
            merged.setdefault(name, []).extend(d for t, d in calls if start <= t < end)
    return {
        name: {
            "n": len(values),
            "p50_ms": round(percentile(values, 0.50) * 1000, 2),
            "p99_ms": round(percentile(values, 0.99) * 1000, 2),
            "mean_ms": round(statistics.fmean(values) * 1000, 2),
        }
        for name, values in sorted(merged.items())
        if values
    }


# ---------------------------------------------------------------- databases


def pg_admin(sql: str) -> None:
    """Run one statement on the PostgreSQL server outside a transaction."""
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as connection:
        connection.execute(sql)


def drop_database(name: str, patience_s: float = 60.0) -> None:
    """Drop a cell's database, retrying while the server is full of dying clients."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(2.0)


@contextlib.contextmanager
def fresh_database(kind: str, tag: str) -> Iterator[str]:
    """A new empty database for one cell, dropped afterwards; yields its SQLAlchemy URL."""
    if kind == "postgresql":
        name = f"vt_bench_{tag}_{os.getpid()}"
        pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        pg_admin(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql+psycopg://{PG_HOST}/{name}"
        finally:
            drop_database(name)
        return
    directory = tempfile.mkdtemp(prefix="vt-bench-")
    try:
        yield f"sqlite:///{directory}/bench.db"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def rdb_storage(url: str) -> RDBStorage:
    """Optuna's RDBStorage with the engine options vramtune uses (WAL and busy timeout)."""
    storage = RDBStorage(url, engine_kwargs=engine_kwargs(url))
    if url.startswith("sqlite"):
        with storage.engine.connect() as connection:
            connection.exec_driver_sql("PRAGMA journal_mode=WAL")
    return storage


def cached_storage(url: str) -> _CachedStorage:
    """What ``optuna.load_study(storage=url)`` builds (``optuna.storages.get_storage``)."""
    return _CachedStorage(rdb_storage(url))


def prefill(engine: sa.Engine, study_id: int, count: int, seed: int = 0) -> None:
    """Add ``count`` COMPLETE trials to a study in one transaction, through Optuna's models."""
    if count == 0:
        return
    rng = random.Random(seed)
    now = datetime.now(UTC).replace(tzinfo=None)
    with engine.begin() as connection:
        highest = sa.func.coalesce(sa.func.max(models.TrialModel.trial_id), 0)
        first = connection.scalar(sa.select(highest))
        assert first is not None
        trials, params, values = [], [], []
        for number in range(count):
            trial_id = first + 1 + number
            x, y = rng.uniform(-10, 10), rng.uniform(-10, 10)
            trials.append(
                {
                    "trial_id": trial_id,
                    "number": number,
                    "study_id": study_id,
                    "state": "COMPLETE",
                    "datetime_start": now,
                    "datetime_complete": now,
                }
            )
            for name, value in (("x", x), ("y", y)):
                params.append(
                    {
                        "trial_id": trial_id,
                        "param_name": name,
                        "param_value": value,
                        "distribution_json": optuna.distributions.distribution_to_json(SPACE[name]),
                    }
                )
            values.append(
                {
                    "trial_id": trial_id,
                    "objective": 0,
                    "value": objective(x, y),
                    "value_type": "FINITE",
                }
            )
        connection.execute(sa.insert(models.TrialModel.__table__), trials)
        connection.execute(sa.insert(models.TrialParamModel.__table__), params)
        connection.execute(sa.insert(models.TrialValueModel.__table__), values)
    if engine.dialect.name == "postgresql":
        with engine.begin() as connection:  # explicit ids: move the sequence past them
            connection.exec_driver_sql(
                "SELECT setval(pg_get_serial_sequence('trials', 'trial_id'),"
                " (SELECT MAX(trial_id) FROM trials))"
            )


def make_sampler(name: str) -> optuna.samplers.BaseSampler:
    """The same sampler for every system: Optuna's defaults."""
    return optuna.samplers.RandomSampler() if name == "random" else optuna.samplers.TPESampler()


def setup_optuna_study(url: str, cell: Cell) -> None:
    """A plain Optuna study, pre-filled (raw and grpc)."""
    storage = rdb_storage(url)
    try:
        study = optuna.create_study(study_name=STUDY, storage=storage)
        prefill(storage.engine, study._study_id, cell.prefill)
    finally:
        storage.engine.dispose()


def setup_vramtune_study(url: str, cell: Cell, n_trials: int = 10**6) -> None:
    """Migrate, create the study with the service's own use case, pre-fill it."""
    engine = make_engine(url)
    try:
        upgrade(engine)
        storage = make_storage(url)
        spec = StudyCreate.model_validate(
            {
                "name": STUDY,
                "task": "quadratic",
                "search_space": {n: {"type": "float", "low": -10, "high": 10} for n in SPACE},
                "sampler": {"name": cell.sampler},
                "n_trials": n_trials,
            }
        )
        with make_sessions(engine).begin() as session:
            row = create_study(session, storage, spec, utcnow())
            study_id = row.study_id
        prefill(engine, study_id, cell.prefill)
        storage._backend.engine.dispose()  # type: ignore[attr-defined]
    finally:
        engine.dispose()


# ---------------------------------------------------------------- processes


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until true; raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():
                return
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s")


def http_ok(port: int, path: str) -> bool:
    """Whether GET path answers 200."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        return connection.getresponse().status == 200
    finally:
        connection.close()


@contextlib.contextmanager
def vramtune_server(url: str, processes: int = 1) -> Iterator[tuple[int, psutil.Process]]:
    """A real ``vramtune serve`` subprocess on the cell's database."""
    port = free_port()
    env = {**os.environ, "VRAMTUNE_DATABASE_URL": url, "VRAMTUNE_LOG_LEVEL": "warning"}
    env["VRAMTUNE_AUTH"] = "off"  # loopback only; the bench measures the fleet, not tokens
    env["VRAMTUNE_PROCESSES"] = str(processes)
    # Simulated workers send no heartbeats: a lease must outlive a trial queued behind 63 others.
    env["VRAMTUNE_LEASE_TTL_S"] = str(BENCH_LEASE_TTL_S)
    env.update(
        {
            k[len("BENCH_SERVER_") :]: v
            for k, v in os.environ.items()
            if k.startswith("BENCH_SERVER_")
        }
    )
    command = [sys.executable, "-m", "vramtune", "serve", "--port", str(port)]
    if os.environ.get("BENCH_SERVER_SCRIPT"):  # an experiment: a script that takes the port
        command = [sys.executable, os.environ["BENCH_SERVER_SCRIPT"], str(port)]
    process = subprocess.Popen(command, env=env, cwd=REPO)
    try:
        wait_until(lambda: http_ok(port, f"{API_PREFIX}/health"), 60, "vramtune server")
        # Warm the server's Optuna cache of the study (a real server has it warm too).
        wait_until(lambda: http_ok(port, f"{API_PREFIX}/studies/{STUDY}"), 120, "study read")
        server = psutil.Process(process.pid)
        wait_until_idle(server)
        yield port, server
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until_idle(server: psutil.Process, settle_s: float = 14.0, cap_s: float = 90.0) -> None:
    """Wait past the server's start-up work: until its processes use < 10 % of a core for 2 s
    in a row, at least ``settle_s`` after it started (the dashboard imports Optuna's
    importance module, scikit-learn included, once it has been quiet for 10 s)."""
    started = server.create_time()
    deadline = time.monotonic() + cap_s
    quiet = 0
    while time.monotonic() < deadline and (quiet < 2 or time.time() - started < settle_s):
        tree = [server, *server.children(recursive=True)]
        before = cpu_seconds(tree)
        time.sleep(1.0)
        quiet = quiet + 1 if cpu_spent(before, cpu_seconds(tree)) < 0.1 else 0


def grpc_server_main(url: str, port: int) -> None:
    """The gRPC proxy server process over the cached RDB storage."""
    from optuna.storages import run_grpc_proxy_server

    run_grpc_proxy_server(cached_storage(url), host="127.0.0.1", port=port)


@contextlib.contextmanager
def grpc_server(url: str) -> Iterator[tuple[int, psutil.Process]]:
    """Optuna's gRPC storage proxy in its own process."""
    port = free_port()
    process = mp.get_context("fork").Process(target=grpc_server_main, args=(url, port))
    process.start()
    assert process.pid is not None
    try:

        def listening() -> bool:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True

        wait_until(listening, 60, "gRPC proxy")
        yield port, psutil.Process(process.pid)
    finally:
        process.terminate()
        process.join(15)
        if process.is_alive():
            process.kill()
            process.join()


# ---------------------------------------------------------------- clients


@dataclass
class Start:
    """Shared by a cell's clients: readiness, the common start and the deadline."""

    ready: Any
    go: Any
    window: Any  # mp.Array('d', [start, end])


def run_client(
    index: int,
    start: Start,
    out: Any,
    warm_up: Callable[[ClientReport], Callable[[], None] | list[Callable[[], None]]],
) -> None:
    """Warm up, wait for the common start, run trials until the deadline, report.

    ``warm_up`` gives one loop body, or several: a process then runs each in its own thread
    (simulated workers of a large fleet are I/O-bound; a process each would take the machine's
    memory). A client that fails to warm up reports ready all the same (with its error), so the
    others do not wait for it.
    """
    report = ClientReport()
    ready = False
    try:
        warmed = warm_up(report)
        bodies = warmed if isinstance(warmed, list) else [warmed]
        start.ready.put(index)
        ready = True
        start.go.wait()
        begin, end = start.window[:]
        time.sleep(max(0.0, begin - time.time()))  # every client starts at the window's start
        cpu_begin = time.process_time()
        threads = [threading.Thread(target=_loop, args=(body, end, report)) for body in bodies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        report.cpu_s = time.process_time() - cpu_begin
    except Exception:
        report.errors.append(traceback.format_exc(limit=3))
    finally:
        if not ready:
            start.ready.put(index)
        out.put((index, asdict(report)))


def _loop(body: Callable[[], None], end: float, report: ClientReport) -> None:
    """Run one loop body until the deadline; an exception is recorded, not raised."""
    try:
        while time.time() < end:
            body()
        drain = getattr(body, "drain", None)
        if drain is not None:  # a simulated worker leased its next trial with its last complete
            drain()
    except Exception:
        report.errors.append(traceback.format_exc(limit=3))


def optuna_client(cell: Cell, target: str | int, index: int, start: Start, out: Any) -> None:
    """A raw (target = URL) or gRPC (target = port) Optuna client: ask, evaluate, tell."""

    def warm_up(report: ClientReport) -> Callable[[], None]:
        if cell.system == "raw":
            storage: Any = cached_storage(str(target))
        else:
            from optuna.storages import GrpcStorageProxy

            storage = GrpcStorageProxy(host="127.0.0.1", port=int(target))
        study = optuna.load_study(
            study_name=STUDY, storage=storage, sampler=make_sampler(cell.sampler)
        )
        study.get_trials(deepcopy=False)  # warm the cache, as a long-running process has it
        return lambda: one_optuna_trial(study, report)

    run_client(index, start, out, warm_up)


def one_optuna_trial(study: optuna.Study, report: ClientReport) -> None:
    """One ask and one tell, each timed; errors are recorded, not raised."""
    wall, began = time.time(), time.perf_counter()
    try:
        trial = study.ask(SPACE)
    except Exception as exc:
        report.errors.append(f"ask: {type(exc).__name__}: {exc}")
        return
    report.timed("ask", began, wall)
    value = objective(trial.params["x"], trial.params["y"])
    wall, began = time.time(), time.perf_counter()
    try:
        study.tell(trial, value)
    except Exception as exc:
        report.errors.append(f"tell: {type(exc).__name__}: {exc}")
        return
    report.timed("tell", began, wall)
    report.completed.append((trial._trial_id, time.time()))


class Http:
    """A keep-alive HTTP/1.1 JSON client on loopback (lean, so the client costs little CPU)."""

    def __init__(self, port: int) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        """POST JSON; the status and the decoded body (None when empty)."""
        payload = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        try:
            self.connection.request("POST", API_PREFIX + path, payload, headers)
            response = self.connection.getresponse()
        except (ConnectionError, http.client.HTTPException):
            self.connection.close()  # reconnect once: a keep-alive socket may have been closed
            self.connection.request("POST", API_PREFIX + path, payload, headers)
            response = self.connection.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else None


def register(http_client: Http, index: int) -> int:
    """Register a simulated worker with a large card; its id."""
    card = {
        "model": "bench-card",
        "total_bytes": CARD_BYTES,
        "free_bytes": CARD_BYTES,
        "simulated": True,
    }
    body = {"name": f"bench-{index}", "device": "cpu", "card": card, "tasks": ["quadratic"]}
    status, reply = http_client.post("/workers", body)
    if status not in (200, 201):
        raise RuntimeError(f"register: {status} {reply}")
    return int(reply["worker_id"])


def vramtune_client(cell: Cell, port: int, index: int, start: Start, out: Any) -> None:
    """Simulated workers (one per thread): next -> start -> complete until the deadline.

    Paced workers (``cell.think``) lease and start their first trial while warming up: the
    window opens part-way through its training (a seeded fraction of one draw)."""

    def warm_up(report: ClientReport) -> list[Callable[[], None]]:
        bodies = []
        per_client = threads_per_client(cell)
        for k in range(per_client):
            client = Http(port)
            worker_id = register(client, index * 1000 + k)
            worker = SimulatedWorker(client, worker_id, report)
            number = index * per_client + k
            if cell.think:
                worker.pacer = Pacer(cell.think, seed=number)
                worker.running = worker.lease_and_start()
                if worker.running is None:
                    raise RuntimeError(f"first trial: {report.errors[-1:]}")
            if cell.heartbeat:  # a thread of its own, as the worker agent's heartbeat thread
                phase = cell.heartbeat * number / cell.workers
                trial_id = worker.running["trial_id"] if worker.running else 0
                worker.beats = Heartbeats(
                    Http(port), worker_id, trial_id, phase, report, period=cell.heartbeat
                )
                bodies.append(worker.beats.one)
            bodies.append(worker)
        return bodies

    run_client(index, start, out, warm_up)


HEARTBEAT_PERIOD_S = 5.0


def heartbeat_client(cell: Cell, port: int, index: int, start: Start, out: Any) -> None:
    """Simulated workers that each hold a lease and heartbeat it every HEARTBEAT_PERIOD_S,
    at evenly spread phases (a fleet's heartbeats are not synchronized)."""

    def warm_up(report: ClientReport) -> list[Callable[[], None]]:
        bodies = []
        per_client = threads_per_client(cell)
        for k in range(per_client):
            client = Http(port)
            worker_id = register(client, index * 1000 + k)
            status, assignment = client.post(
                f"/workers/{worker_id}/next", {"free_bytes": CARD_BYTES}
            )
            if status != 200:
                raise RuntimeError(f"next: {status} {assignment}")
            phase = HEARTBEAT_PERIOD_S * (index * per_client + k) / cell.workers
            beat = Heartbeats(client, worker_id, assignment["trial_id"], phase, report)
            bodies.append(beat.one)
        return bodies

    run_client(index, start, out, warm_up)


@dataclass
class Heartbeats:
    """One simulated worker's heartbeats, on a connection of their own: due every ``period``
    from its phase. A paced worker points ``trial_id`` at each trial it starts (a trial it
    completed while a heartbeat listing it was on its way is not ordered stopped)."""

    client: Http
    worker_id: int
    trial_id: int
    phase: float
    report: ClientReport
    due: float = 0.0
    period: float = HEARTBEAT_PERIOD_S

    def one(self) -> None:
        """Wait until the next heartbeat is due, send it; a stop order or non-200 is an error."""
        if not self.due:
            self.due = time.time() + self.phase
        time.sleep(max(0.0, self.due - time.time()))
        self.due += self.period
        body = {"free_bytes": CARD_BYTES, "trials": [self.trial_id]}
        path = f"/workers/{self.worker_id}/heartbeat"
        status, reply = timed_post(self.client, self.report, "heartbeat", path, body)
        if status != 200 or reply["stop"]:
            self.report.errors.append(f"heartbeat: {status} {reply}")


def threads_per_client(cell: Cell) -> int:
    """Simulated workers per client process: one each up to 64, else spread over 16."""
    return 1 if cell.workers <= 64 else math.ceil(cell.workers / MAX_CLIENT_PROCESSES)


def client_processes(cell: Cell) -> int:
    """How many client processes a cell forks."""
    return math.ceil(cell.workers / threads_per_client(cell))


def timed_post(
    client: Http, report: ClientReport, name: str, path: str, body: Any
) -> tuple[int, Any]:
    """POST and record the call's latency under ``name``."""
    wall, began = time.time(), time.perf_counter()
    status, reply = client.post(path, body)
    report.timed(name, began, wall)
    return status, reply


@dataclass
class Pacer:
    """A paced worker's training time: each trial trains for a draw from a uniform
    [0.5 S, 1.5 S] (seeded per worker, so that workers do not move in lockstep). The first
    draw is cut to a seeded fraction of itself: the window opens part-way through the first
    trial, as it would on a fleet already running."""

    think_s: float
    seed: int
    rng: random.Random = field(init=False)
    first: bool = True

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def draw(self) -> float:
        """Seconds the next trial trains."""
        think = self.rng.uniform(0.5 * self.think_s, 1.5 * self.think_s)
        if self.first:
            self.first = False
            think *= self.rng.random()
        return think


@dataclass
class SimulatedWorker:
    """One simulated worker: next -> start -> complete, the complete asking for the next trial
    (``CompleteRequest.next``), so that a trial costs two requests once the first is leased.
    With a ``pacer`` it trains between ``start`` and ``complete``; ``beats`` (heartbeating on
    their own thread) are told each trial it starts."""

    client: Http
    worker_id: int
    report: ClientReport
    assignment: dict[str, Any] | None = None  # leased, not started
    pacer: Pacer | None = None
    running: dict[str, Any] | None = None  # started, not completed (a paced worker's first)
    beats: Heartbeats | None = None

    def __call__(self) -> None:
        self.one()

    def drain(self) -> None:
        """After the window: complete the trial the last complete leased, asking for no more."""
        if self.assignment is not None or self.running is not None:
            self.one(ask_next=False)

    def lease_and_start(self) -> dict[str, Any] | None:
        """Lease a trial unless the last complete did, and start it; None (recorded) if not."""
        if self.assignment is None:
            path = f"/workers/{self.worker_id}/next"
            status, reply = timed_post(self.client, self.report, "next", path, NEXT)
            if status == 204:
                self.report.empty_nexts += 1
                return None
            if status != 200:
                self.report.errors.append(f"next: {status} {reply}")
                return None
            self.assignment = reply
        assignment, self.assignment = self.assignment, None
        status, reply = timed_post(
            self.client,
            self.report,
            "start",
            f"/trials/{assignment['trial_id']}/start",
            {"lease": assignment["lease"], "plan": {}},
        )
        if status != 200:
            self.report.errors.append(f"start: {status} {reply}")
            return None
        if self.beats is not None:
            self.beats.trial_id = assignment["trial_id"]
        return assignment

    def one(self, ask_next: bool = True) -> None:
        """One trial; a non-2xx answer is an error, recorded."""
        assignment, self.running = self.running or self.lease_and_start(), None
        if assignment is None:
            return
        trial_id, lease = assignment["trial_id"], assignment["lease"]
        if self.pacer is not None and ask_next:  # the drain after the window does not train
            time.sleep(self.pacer.draw())
        value = objective(assignment["params"]["x"], assignment["params"]["y"])
        body = {
            "lease": lease,
            "values": [value],
            "plan": {},
            "duration_s": 0.0,
            "measured": {"peak_allocated_bytes": 1 << 20},
            **({"next": NEXT} if ask_next else {}),
        }
        path = f"/trials/{trial_id}/complete"
        status, reply = timed_post(
            self.client, self.report, "complete+next" if ask_next else "complete", path, body
        )
        if status != 200:
            self.report.errors.append(f"complete: {status} {reply}")
            return
        self.report.completed.append((trial_id, time.time()))
        self.assignment = reply.get("next")


NEXT = {"free_bytes": CARD_BYTES}


class CellSkipped(Exception):
    """The cell cannot run here (its clients would exhaust memory, or never got ready)."""


def wait_ready(start: Start, count: int) -> None:
    """Wait for every client to be warm; CellSkipped if memory runs low or it takes too long."""
    deadline = time.monotonic() + READY_TIMEOUT_S[0]
    ready = 0
    while ready < count:
        with contextlib.suppress(queue.Empty):
            start.ready.get(timeout=1.0)
            ready += 1
        available = psutil.virtual_memory().available
        if available < MIN_FREE_BYTES:
            raise CellSkipped(
                f"skipped: {ready} of {count} clients warm left {available / 2**30:.1f} GiB free"
            )
        if time.monotonic() > deadline:
            raise CellSkipped(f"skipped: {ready} of {count} clients warm in {READY_TIMEOUT_S[0]} s")


def run_clients(
    cell: Cell,
    target: Callable[..., None],
    arg: str | int,
    duration_s: float,
    on_start: Callable[[], None] = lambda: None,
) -> tuple[list[ClientReport], float, float]:
    """Fork N clients, start them together once all are warm, collect their reports.

    ``on_start`` runs once every client is warm, just before the window opens: the service's
    CPU is read from there, so the clients' warm-up (registering, the first lease) is not
    charged to the window.
    """
    context = mp.get_context("fork")
    start = Start(context.Queue(), context.Event(), context.Array("d", [0.0, 0.0]))
    out = context.Queue()
    processes = [
        context.Process(target=target, args=(cell, arg, i, start, out), daemon=True)
        for i in range(client_processes(cell))
    ]
    for process in processes:
        process.start()
    try:
        wait_ready(start, len(processes))
    except CellSkipped:
        for process in processes:
            process.kill()
        for process in processes:
            process.join(30)
        raise
    on_start()
    begin = time.time() + 0.2
    start.window[:] = [begin, begin + duration_s]
    start.go.set()
    reports = [ClientReport(**out.get(timeout=duration_s + 300)[1]) for _ in processes]
    for process in processes:
        process.join(30)
    return reports, begin, begin + duration_s


# ---------------------------------------------------------------- checks


def check_study(url: str, prefilled: int, reports: list[ClientReport]) -> dict[str, Any]:
    """Every trial COMPLETE exactly once, and the clients' completed ids are the new trials.

    Trials vramtune asked ahead that no worker leased before the window closed are RUNNING in
    Optuna and pending in vramtune, never leased: counted apart, not as a failure.
    """
    storage = rdb_storage(url)
    try:
        study_id = storage.get_study_id_from_name(STUDY)
        trials = storage.get_all_trials(study_id, deepcopy=False)
        with storage.engine.connect() as connection:
            values_per_trial = dict(
                connection.execute(
                    sa.select(models.TrialValueModel.trial_id, sa.func.count()).group_by(
                        models.TrialValueModel.trial_id
                    )
                ).all()
            )
            ahead = asked_ahead(connection)
    finally:
        storage.engine.dispose()
    states: dict[str, int] = {}
    for trial in trials:
        states[trial.state.name] = states.get(trial.state.name, 0) + 1
    numbers = sorted(t.number for t in trials)
    told = [tid for r in reports for tid, _ in r.completed]
    ran = [t for t in trials if t._trial_id not in ahead]
    new_ids = sorted(t._trial_id for t in ran if t.number >= prefilled)
    problems = []
    if any(t.state.name != "COMPLETE" for t in ran):
        problems.append(f"not all COMPLETE: {states} ({len(ahead)} asked ahead)")
    if numbers != list(range(len(trials))):
        problems.append("trial numbers are not 0..n-1 exactly once")
    if len(told) != len(set(told)):
        problems.append(f"{len(told) - len(set(told))} trials completed twice by clients")
    if sorted(told) != new_ids:
        problems.append(f"clients completed {len(told)} trials, the study has {len(new_ids)} new")
    if any(values_per_trial.get(t._trial_id, 0) != 1 for t in ran):
        problems.append("a trial has other than one stored value")
    return {
        "ok": not problems,
        "problems": problems,
        "states": states,
        "new_trials": len(new_ids),
        "asked_ahead": len(ahead),
    }


def check_leases(
    url: str, cell: Cell, reports: list[ClientReport], duration_s: float
) -> dict[str, Any]:
    """The heartbeat cell: every worker heartbeat on time and still holds its one lease."""
    sent = sum(len(r.calls.get("heartbeat", [])) for r in reports)
    expected = cell.workers * int(duration_s // HEARTBEAT_PERIOD_S)
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            query = sa.text(
                "SELECT count(*) FROM vramtune_leases WHERE active AND expires_at > :now"
            )
            now = datetime.now(UTC).replace(tzinfo=None)
            live = int(connection.execute(query, {"now": now}).scalar() or 0)
    finally:
        engine.dispose()
    problems = []
    if sent < expected:
        problems.append(f"{sent} heartbeats sent, {expected} due")
    if live != cell.workers:
        problems.append(f"{live} live leases, {cell.workers} workers")
    return {"ok": not problems, "problems": problems, "heartbeats": sent, "live_leases": live}


def asked_ahead(connection: sa.Connection) -> set[int]:
    """Trials vramtune asked and holds pending that were never leased (none for raw Optuna)."""
    if not sa.inspect(connection).has_table("vramtune_trials"):
        return set()
    query = sa.text(
        "SELECT trial_id FROM vramtune_trials WHERE status = 'pending' AND trial_id NOT IN "
        "(SELECT trial_id FROM vramtune_leases)"
    )
    return {int(trial_id) for (trial_id,) in connection.execute(query)}


# ---------------------------------------------------------------- one cell


@contextlib.contextmanager
def system_under_test(
    cell: Cell, url: str
) -> Iterator[tuple[Callable[..., None], str | int, psutil.Process | None]]:
    """Set up the study and whatever server the system needs; yields client, target, server."""
    if cell.system.startswith("vramtune") or cell.system == "heartbeats":
        setup_vramtune_study(url, cell)
        client = heartbeat_client if cell.system == "heartbeats" else vramtune_client
        with vramtune_server(url, processes=2 if cell.system == "vramtune2" else 1) as served:
            yield client, *served
        return
    setup_optuna_study(url, cell)
    if cell.system == "raw":
        yield optuna_client, url, None
        return
    with grpc_server(url) as (port, process):
        yield optuna_client, port, process


def run_cell(cell: Cell, duration_s: float, tag: str, repeat: int = 0) -> CellResult:
    """Measure one cell on a fresh database; a cell that cannot run says why."""
    load_before = os.getloadavg()[0]
    try:
        result = measure_cell(cell, duration_s, tag)
    except CellSkipped as skipped:
        result = CellResult(cell, duration_s, 0, 0.0, {}, 0, [], {"ok": None, "problems": []})
        result.notes.append(str(skipped))
    result.repeat = repeat
    result.load = (round(load_before, 1), round(os.getloadavg()[0], 1))
    return result


def measure_cell(cell: Cell, duration_s: float, tag: str) -> CellResult:
    """Set the cell up, run its clients, check the study."""
    with fresh_database(cell.database, tag) as url:
        with system_under_test(cell, url) as (client, target, server):
            servers = [server, *server.children(recursive=True)] if server else []
            before: dict[int, float] = {}
            backends: list[psutil.Process] = []

            timings: dict[str, tuple[float, float]] = {}
            served = server is not None and cell.system != "grpc"

            profiles: list[subprocess.Popen[bytes]] = []

            def window_opens() -> None:
                backends[:] = database_backends(url)
                before.update(cpu_seconds([*servers, *backends]))
                if served:
                    timings.update(server_timings(int(target)))
                    profiles.extend(profile_window(servers, duration_s, cell.label()))

            reports, begin, end = run_clients(cell, client, target, duration_s, window_opens)
            for profiler in profiles:
                profiler.wait(60)
            phases = timings_between(timings, server_timings(int(target))) if served else {}
            # Backends the pools opened during the window: all their CPU is the window's.
            opened = [p for p in database_backends(url) if p.pid not in before]
            before |= {p.pid: 0.0 for p in opened}
            after = cpu_seconds([*servers, *backends, *opened])
            system_cpu = cpu_spent(before, after)
            server_cpu = cpu_spent({p.pid: before.get(p.pid, 0.0) for p in servers}, after)
            server_rss = server.memory_info().rss / 2**20 if server else None
        heartbeats = cell.system == "heartbeats"
        check = (
            check_leases(url, cell, reports, duration_s)
            if heartbeats
            else check_study(url, cell.prefill, reports)
        )
    done = sum(1 for r in reports for _, t in r.completed if begin <= t < end)
    errors = [e for r in reports for e in r.errors]
    notes = []
    empty = sum(r.empty_nexts for r in reports)
    if empty:
        notes.append(f"{empty} next calls answered 204 (no work)")
    cpu = system_cpu + sum(r.cpu_s for r in reports)
    return CellResult(
        cell=cell,
        duration_s=duration_s,
        trials=done,
        trials_per_s=round(done / duration_s, 2),
        latency_ms=latency_summary(reports, begin, end),
        errors=len(errors),
        error_samples=errors[:5],
        check=check,
        server_cpu_s=round(server_cpu, 2) if servers else None,
        server_rss_mib=None if server_rss is None else round(server_rss, 1),
        cpu_ms_per_trial=round(1000 * cpu / done, 1) if done else None,
        notes=notes,
        service_core_pct=round(100 * system_cpu / duration_s, 2),
        phases_ms=phases,
    )


def profile_window(
    servers: list[psutil.Process], duration_s: float, label: str
) -> list[subprocess.Popen[bytes]]:
    """With ``BENCH_PYSPY`` (a path prefix), py-spy records each server process over the
    window only (not its start-up or the clients' warm-up), in py-spy's raw (collapsed) format;
    ``BENCH_PYSPY_ARGS`` adds options, e.g. ``--gil -r 200`` (only threads holding the GIL:
    where the CPU goes). Summarize with ``bench/profile_summary.py``."""
    prefix = os.environ.get("BENCH_PYSPY")
    if not prefix:
        return []
    py_spy = str(Path(sys.executable).with_name("py-spy"))
    extra = os.environ.get("BENCH_PYSPY_ARGS", "-r 100").split()
    tag = label.replace("/", "_").replace("=", "")
    return [
        subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(process.pid),
                "-d",
                str(math.ceil(duration_s)),
                "-f",
                "raw",
                "--nonblocking",
                *extra,
                "-o",
                f"{prefix}{tag}_{process.pid}.txt",
            ],
            stdout=subprocess.DEVNULL,
        )
        for process in servers
        if process.name().startswith("python")
    ]


def database_backends(url: str) -> list[psutil.Process]:
    """The PostgreSQL backends connected to the cell's database now (its pools are warm)."""
    if not url.startswith("postgresql"):
        return []
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as connection:
        query = "SELECT pid FROM pg_stat_activity WHERE datname = %s"
        pids = [int(pid) for (pid,) in connection.execute(query, (url.rsplit("/", 1)[1],))]
    return [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]


def server_timings(port: int) -> dict[str, tuple[float, float]]:
    """(seconds, count) summed per request route and per call phase, from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    sums: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (
            "vramtune_http_request_duration_seconds",
            "vramtune_call_phase_seconds",
        ):
            continue
        for sample in family.samples:
            if not sample.name.endswith(("_sum", "_count")):
                continue
            labels = sample.labels
            if "phase" in labels:
                key = f"phase {labels['call']}/{labels['phase']}"
            else:
                key = f"route {labels['route'].rsplit('/', 1)[-1]}"
            slot = sums.setdefault(key, [0.0, 0.0])
            slot[0 if sample.name.endswith("_sum") else 1] += sample.value
    return {key: (total, count) for key, (total, count) in sums.items()}


def timings_between(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, dict[str, float]]:
    """Mean ms and count per key over the window (two server_timings readings)."""
    means = {}
    for key, (total, count) in sorted(after.items()):
        total0, count0 = before.get(key, (0.0, 0.0))
        if count > count0:
            n = count - count0
            means[key] = {"n": n, "mean_ms": round(1000 * (total - total0) / n, 2)}
    return means


def cpu_seconds(processes: list[psutil.Process]) -> dict[int, float]:
    """User + system CPU seconds of each process still there, by pid."""
    readings = {}
    for process in processes:
        with contextlib.suppress(psutil.Error):
            readings[process.pid] = sum(process.cpu_times()[:2])
    return readings


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two readings (a process gone meanwhile counts nothing)."""
    return sum(after.get(pid, seconds) - seconds for pid, seconds in before.items())


def cell_duration(cell: Cell, duration_s: float) -> float:
    """A window long enough for a few trials per client: TPE on a large study asks slowly,
    and 64 clients queue long."""
    if cell.system == "heartbeats":
        return max(duration_s, HEARTBEAT_CELL_S)
    slow = (cell.sampler == "tpe" and cell.prefill > 0) or cell.workers >= 64
    return max(duration_s, SLOW_CELL_S) if slow else duration_s


# ---------------------------------------------------------------- matrix and output

PRESETS: dict[str, list[tuple[str, str, int, list[int]]]] = {
    # (database, sampler, prefill, workers): the cells the committed results hold.
    "default": [
        ("postgresql", "random", 0, [1, 4, 16, 64]),
        ("postgresql", "tpe", 10_000, [1, 4, 16, 64]),
        ("sqlite", "random", 0, [16]),
    ],
    "smoke": [("sqlite", "random", 0, [1, 4])],
}


def cells_of(args: argparse.Namespace) -> list[Cell]:
    """The cells to run, from a preset or the product of the matrix flags."""
    systems = args.systems.split(",")
    if args.preset:
        groups = PRESETS[args.preset]
    else:
        groups = [
            (db, sampler, int(prefill), [int(n) for n in args.workers.split(",")])
            for db, sampler, prefill in itertools.product(
                args.databases.split(","), args.samplers.split(","), args.prefill.split(",")
            )
        ]
    heartbeat = args.paced_heartbeat if args.think else 0.0
    return [
        Cell(system, db, sampler, prefill, n, args.think, heartbeat)
        for db, sampler, prefill, ns in groups
        for n in ns
        for system in systems
    ]


def ratio(value: float, base: float | None) -> str:
    """value / base as '3.2x', or '-' without a base."""
    return f"{value / base:.1f}x" if base else "-"


def markdown(results: list[CellResult], meta: dict[str, Any]) -> str:
    """The results as a Markdown report: one table per (database, sampler, pre-fill)."""
    lines = [
        "# Service throughput: raw Optuna vs Optuna gRPC proxy vs vramtune",
        "",
        f"Latest run {meta['date']} on {meta['machine']}; {meta['duration_s']} s per cell "
        f"({SLOW_CELL_S:g} s for TPE on a pre-filled study and for 64 workers); "
        f"Optuna {meta['optuna']}, Python {meta['python']}. Generated by "
        "`bench/service_throughput.py`; raw figures in `service_throughput.json`.",
        "",
        "trials/s counts trials completed inside the window; latencies are per call (raw and "
        "gRPC: ask, tell; vramtune over HTTP: next (a worker's first trial only), start, and "
        "complete+next, the complete that also leases the worker's next trial "
        "(`CompleteRequest.next`; earlier runs: complete, then next)); `check` = every trial of "
        "the study COMPLETE exactly once and the clients' completed trials are exactly the study's "
        "new ones (vramtune: trials it asked ahead and no worker has leased yet are left out: "
        "they are RUNNING in Optuna, pending in vramtune). CPU ms/trial = CPU seconds of every "
        "process of the system (clients, server processes, the cell database's PostgreSQL "
        "backends) per completed trial: what a trial costs, whatever share of this shared "
        "machine the system got; `raw's CPU / this` > 1 means cheaper than raw Optuna. "
        "`vramtune2` = vramtune with `--processes 2`. "
        "gRPC needs `grpcio` and `protobuf` (installed for this benchmark only). "
        f"The vramtune server runs with a lease TTL of {BENCH_LEASE_TTL_S} s (its simulated "
        "workers send no heartbeats, except in the paced cells).",
        "",
    ]
    runs = []
    run: dict[str, Any] | None = meta
    while run is not None:
        runs.append(f"{run['date']} (`{' '.join(run['argv']) or '(no arguments)'}`)")
        run = run.get("earlier_run")
    if len(runs) > 1:
        merged = "; ".join(reversed(runs))
        lines[2:2] = [
            f"Cells merged from several runs, later ones replacing earlier: {merged}.",
            "",
        ]
    groups: dict[tuple[str, str, int], list[CellResult]] = {}
    for result in results:
        c = result.cell
        if c.system != "heartbeats" and not c.think:
            groups.setdefault((c.database, c.sampler, c.prefill), []).append(result)
    order = sorted(groups, key=lambda key: (key[0] != "postgresql", key[1] != "random", key[2]))
    for db, sampler, pre in order:
        lines += [f"## {db}, {sampler}, {pre:,} trials pre-filled", ""]
        lines += trial_table(groups[(db, sampler, pre)])
    beats = [r for r in results if r.cell.system == "heartbeats"]
    if beats:
        lines += [
            "## Heartbeats: simulated workers, each holding a lease, every "
            f"{HEARTBEAT_PERIOD_S:g} s",
            "",
            "service CPU = the server's processes and the cell database's backends (not the "
            "simulated workers), in percent of one core over the window.",
            "",
        ]
        lines += heartbeat_table(beats)
    paced = [r for r in results if r.cell.think]
    if paced:
        lines += [
            "## Paced: simulated workers that train between calls",
            "",
            "Each trial trains for a seeded uniform draw from [0.5 think, 1.5 think] between "
            "`start` and `complete+next`; each worker heartbeats its trial every `heartbeat` "
            "seconds on a thread and connection of its own, as the worker agent does (5 s, the "
            "server's default; a heartbeat's reply waits for its batch, up to 0.5 s, by design). "
            "Each worker leased and started its first trial before the window, which opens "
            "part-way through it. offered = N / think "
            "trials/s (what the fleet asks for if the calls took no time); achieved = trials "
            "completed inside the window per second. service CPU = the server's processes and "
            "the cell database's backends, in percent of one core over the window.",
            "",
        ]
        lines += paced_table(paced)
    return "\n".join(lines)


def runs_of(results: list[CellResult]) -> dict[tuple[int, str], list[CellResult]]:
    """The runs of each (N, system), in run order."""
    runs: dict[tuple[int, str], list[CellResult]] = {}
    for r in sorted(results, key=lambda r: r.repeat):
        runs.setdefault((r.cell.workers, r.cell.system), []).append(r)
    return runs


def spread(values: list[float], digits: int = 1) -> str:
    """The median, and the range when there is more than one value: '12.3 (11.0-14.1)'."""
    if not values:
        return "-"
    median = f"{statistics.median(values):.{digits}f}"
    if len(values) == 1:
        return median
    return f"{median} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def paired_ratio(these: list[CellResult], bases: list[CellResult], key: str, invert: bool) -> str:
    """Median over runs of this/base (base/this when ``invert``), pairing runs by repeat:
    the cells of one repeat ran one after the other, under the same load."""
    base_by = {b.repeat: getattr(b, key) for b in bases}
    ratios = []
    for r in these:
        value, base = getattr(r, key), base_by.get(r.repeat)
        if value and base:
            ratios.append(base / value if invert else value / base)
    return f"{spread(ratios)}x" if ratios else "-"


def calls_summary(runs: list[CellResult]) -> str:
    """p50 / p99 per call, the median over runs."""
    names = sorted({name for r in runs for name in r.latency_ms})
    parts = []
    for name in names:
        p50 = [r.latency_ms[name]["p50_ms"] for r in runs if name in r.latency_ms]
        p99 = [r.latency_ms[name]["p99_ms"] for r in runs if name in r.latency_ms]
        parts.append(f"{name} {statistics.median(p50):g} / {statistics.median(p99):g}")
    return ", ".join(parts)


def checks_summary(runs: list[CellResult]) -> str:
    """ok when every run's check passed; else the first problems."""
    failed = [r for r in runs if r.check["ok"] is False]
    if failed:
        return "FAIL: " + "; ".join(failed[0].check["problems"])
    return "ok" if any(r.check["ok"] for r in runs) else "-"


def loads_summary(runs: list[CellResult]) -> str:
    """The range of the load averages the runs met."""
    loads = [x for r in runs if r.load for x in r.load]
    notes = sorted({n for r in runs for n in r.notes if not n.startswith("load average")})
    text = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"
    return "; ".join([text, *notes])


def trial_table(group: list[CellResult]) -> list[str]:
    """One row per (N, system): medians over its runs, ratios paired with raw's runs."""
    lines = [
        "| N | system | runs | trials/s | x raw | CPU ms/trial | raw's CPU / this | "
        "p50 / p99 ms per call | errors | check | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = runs_of(group)
    for (n, system), these in sorted(runs.items(), key=lambda i: (i[0][0], SYSTEMS.index(i[0][1]))):
        raw = runs.get((n, "raw"), [])
        cpu = [r.cpu_ms_per_trial for r in these if r.cpu_ms_per_trial]
        lines.append(
            f"| {n} | {system} | {len(these)} | {spread([r.trials_per_s for r in these])} | "
            f"{paired_ratio(these, raw, 'trials_per_s', invert=False)} | {spread(cpu)} | "
            f"{paired_ratio(these, raw, 'cpu_ms_per_trial', invert=True)} | "
            f"{calls_summary(these)} | {sum(r.errors for r in these)} | "
            f"{checks_summary(these)} | {loads_summary(these)} |"
        )
    lines.append("")
    return lines


def heartbeat_table(beats: list[CellResult]) -> list[str]:
    """One row per fleet size: heartbeats per second and what they cost the service."""
    lines = [
        "| workers | runs | heartbeats/s | service CPU, % of one core | p50 / p99 ms | errors | "
        "check | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (n, _), these in sorted(runs_of(beats).items()):
        rates = [r.latency_ms.get("heartbeat", {}).get("n", 0) / r.duration_s for r in these]
        cores = [r.service_core_pct for r in these if r.service_core_pct is not None]
        lines.append(
            f"| {n} | {len(these)} | {spread(rates)} | {spread(cores)} | {calls_summary(these)} | "
            f"{sum(r.errors for r in these)} | {checks_summary(these)} | {loads_summary(these)} |"
        )
    lines.append("")
    return lines


def paced_table(paced: list[CellResult]) -> list[str]:
    """One row per paced cell: offered and achieved trials/s, latencies, the service's CPU."""
    lines = [
        "| N | system | sampler, pre-filled | think s | heartbeat s | runs | offered trials/s | "
        "achieved trials/s | achieved / offered | p50 / p99 ms per call | service CPU, % of one "
        "core | errors | check | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells: dict[Cell, list[CellResult]] = {}
    for r in sorted(paced, key=lambda r: r.repeat):
        cells.setdefault(r.cell, []).append(r)
    order = sorted(
        cells, key=lambda c: (c.database, c.sampler, c.prefill, c.workers, c.think, c.system)
    )
    for c in order:
        these = cells[c]
        offered = c.workers / c.think
        achieved = [r.trials_per_s for r in these]
        cores = [r.service_core_pct for r in these if r.service_core_pct is not None]
        lines.append(
            f"| {c.workers} | {c.system} | {c.database} {c.sampler}, {c.prefill:,} | "
            f"{c.think:g} | {c.heartbeat:g} | {len(these)} | {offered:.1f} | {spread(achieved)} | "
            f"{spread([a / offered for a in achieved], 2)} | {calls_summary(these)} | "
            f"{spread(cores)} | {sum(r.errors for r in these)} | {checks_summary(these)} | "
            f"{loads_summary(these)} |"
        )
    lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the chosen cells and write the Markdown and JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--systems", default="raw,grpc,vramtune")
    parser.add_argument("--databases", default="postgresql")
    parser.add_argument("--samplers", default="random")
    parser.add_argument("--prefill", default="0")
    parser.add_argument("--workers", default="1,4,16,64")
    parser.add_argument("--duration", type=float, default=12.0, help="seconds per cell")
    parser.add_argument(
        "--think",
        type=float,
        default=0.0,
        help="paced cells (vramtune only): mean seconds a worker trains between start and "
        "complete, drawn per trial from [0.5, 1.5] times it; 0 = closed loop",
    )
    parser.add_argument(
        "--paced-heartbeat",
        type=float,
        default=HEARTBEAT_PERIOD_S,
        help="seconds between a paced worker's heartbeats; 0 = none",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of every cell, interleaved: run 1 of each, ..."
    )
    parser.add_argument(
        "--time-limit", type=float, default=0.0, help="stop starting cells after this many seconds"
    )
    parser.add_argument(
        "--out",
        default=str(REPO / "bench/results/service_throughput"),
        help="path prefix of the .md and .json results; '' to skip writing",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to warm up")
    parser.add_argument(
        "--append", action="store_true", help="merge into the results already under --out"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the .md from the .json; run nothing"
    )
    args = parser.parse_args(argv)
    READY_TIMEOUT_S[0] = args.ready_timeout
    if args.think < 0 or args.paced_heartbeat < 0:
        parser.error("--think and --paced-heartbeat take seconds >= 0")
    if args.think and not {"vramtune", "vramtune2"}.issuperset(args.systems.split(",")):
        parser.error("--think paces vramtune's simulated workers: --systems vramtune,vramtune2")
    if args.report_only:
        saved = json.loads(Path(f"{args.out}.json").read_text())
        write_results(previous_results(args.out), saved["meta"], args.out)
        return 0
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} cores, {platform.platform()}",
        "duration_s": args.duration,
        "optuna": optuna.__version__,
        "python": platform.python_version(),
        "argv": sys.argv[1:] if argv is None else argv,
    }
    results = previous_results(args.out) if args.append else []
    if args.append and Path(f"{args.out}.json").exists():
        meta["earlier_run"] = json.loads(Path(f"{args.out}.json").read_text())["meta"]
    cells = cells_of(args)
    results = [r for r in results if r.cell not in cells]  # this run's cells replace earlier ones
    run_began = time.monotonic()
    for repeat, (number, cell) in itertools.product(range(args.repeat), enumerate(cells)):
        if args.time_limit and time.monotonic() - run_began > args.time_limit:
            print(f"time limit of {args.time_limit:g} s reached: stopping")
            break
        began = time.monotonic()
        result = run_cell(cell, cell_duration(cell, args.duration), f"{number}", repeat)
        results.append(result)
        took = time.monotonic() - began
        print(f"{cell.label():40s} #{repeat} {summary_line(result)} ({took:.0f} s)")
        if args.out:  # after every cell: a run cut short keeps what it measured
            write_results(results, meta, args.out)
    return 0 if all(r.check["ok"] is not False and not r.errors for r in results) else 1


def previous_results(out: str) -> list[CellResult]:
    """The cells of an earlier run under the same ``--out`` prefix (for ``--append``)."""
    path = Path(f"{out}.json")
    if not path.exists():
        return []
    cells = json.loads(path.read_text())["cells"]
    return [
        CellResult(
            **{**c, "cell": Cell(**c["cell"]), "load": tuple(c["load"]) if c.get("load") else None}
        )
        for c in cells
    ]


def summary_line(result: CellResult) -> str:
    """One cell in one line, for the console."""
    check = "ok" if result.check["ok"] else result.check["problems"]
    return (
        f"{result.trials_per_s:8.1f} trials/s  cpu {result.cpu_ms_per_trial} ms/trial  "
        f"service {result.service_core_pct} % of a core  load {result.load}  "
        f"errors {result.errors}  check {check}  "
        f"{json.dumps(result.latency_ms)}  {'; '.join(result.notes)}"
        + (f"\n    server: {json.dumps(result.phases_ms)}" if result.phases_ms else "")
    )


def write_results(results: list[CellResult], meta: dict[str, Any], out: str) -> None:
    """The JSON and Markdown results under the ``--out`` prefix."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    cells = [asdict(r) for r in results]
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    report = Path(f"{out}.md")
    kept = report.read_text().partition(ANALYSIS_MARK)[2] if report.exists() else ""
    report.write_text(markdown(results, meta) + (f"\n{ANALYSIS_MARK}{kept}" if kept else ""))


if __name__ == "__main__":
    raise SystemExit(main())
