"""A fleet of simulated cards against the real service: what each card costs it (issue 48).

N simulated cards of a mix of sizes (``--mix 24GiB:0.6,80GiB:0.3,8x80GiB:0.1``: shares of the
cards; ``8x80GiB`` is a node of eight 80 GiB cards, one worker) are lightweight clients of the
real REST API: asyncio tasks on httpx.AsyncClient, many per process, no torch. Each speaks the
worker's protocol as vramtune/worker/loop/agent.py does: register, a heartbeat every
``heartbeat_interval_s`` naming the trials it holds (and one at once after each lease), ``next``
(a node: one per free card, with ``free_cards``), per trial ``GET /step-time`` and ``GET
/calibration`` (the agent's plan choice), then ``start``, ``report`` every ``--report-every-min``,
and ``complete`` asking for the next trial (one-card workers, as the agent does); a trial whose
footprint does not fit the card is handed back (``handback``) and waits for a larger card, or
ends infeasible when no card holds it.

Time: trial lengths are drawn in simulated minutes (log-normal, mean ``--trial-minutes``,
between 1 minute and 4 hours) and run ``--time-factor`` times faster; the server is started with
its heartbeat interval, lease TTL, worker_stale_s and reaper interval divided by the same factor,
so every protocol interval keeps its proportion. (Not scaled: the heartbeat batch window of
vramtune.service.fleet.heartbeats, 0.5 s real; keep the real heartbeat interval well above it.)

Trials: the study (random sampler, no pruner) has a parameter ``u`` uniform in [0, 1) that sets
the footprint: ``u < --infeasible-share``: 4 TiB (no card holds it: handed back, ends
infeasible); the next ``--handback-share``: 48 GiB (a 24 GiB card hands it back, it waits for
an 80 GiB one); else 12 GiB. Its budget (``n_trials``) is what the fleet runs in the warm-up and
the window, with 20 % to spare.

Churn: each worker leaves gracefully (its trials sent back ``interrupted``, then ``stop``) at
``--leave-per-hour`` and dies abruptly (it stops calling, mid-request or not; its leases
expire and the reaper offers the trials again) at ``--death-per-hour``, per simulated hour; a
worker of the same kind joins a simulated minute later, so the fleet keeps its size.

Phases: workers join over ``--warmup-min``; the measurement window is the next ``--window-min``
(simulated); then the drain: churn stops, running trials end at once, the rest of the budget
runs in no time, and the run waits until the study is done. Then the accounting, from the
database and Optuna: every trial of the budget finished exactly once (0 lost, 0 duplicated,
0 stuck).

Measured over the window: the service's CPU (server processes from /proc, and PostgreSQL's
backends of the run's database) per simulated card-hour, SQL statements and commits per
card-hour by call (counted in the server by bench/fleet_statements.py), the calls per
card-hour and their latency (p50/p99 as the clients saw it), the load average.

Usage: ``python bench/fleet_sim.py --cards 1000 --time-factor 5`` (PostgreSQL, one replica);
``--replicas 2``; ``--database sqlite``; results go to bench/results/fleet_sim.{md,json}, one
run per (database, replicas, cards, time factor), replaced when run again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import ssl
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import write_report  # noqa: E402
from vramtune.service.testing import (  # noqa: E402
    PG_ADMIN_DSN,
    ServerProcess,
    fresh_postgres_database,
    sqlite_url,
    upgrade_database,
)

GIB = 2**30
API = "/api/v1"
STUDY = "fleet"
TASK = "sim"
FOOTPRINTS = {"small": 12 * GIB, "large": 48 * GIB, "huge": 4096 * GIB}
MARGIN = 0.10  # the study's memory_policy.margin (its default): held back on each card
MIN_TRIAL_MIN, MAX_TRIAL_MIN = 1.0, 240.0
SIGMA = 1.0  # of the log-normal trial length
JOIN_DELAY_MIN = 1.0
IDLE_POLL_S = 1.0  # the agent's idle_poll_s, simulated
DRAIN_LIMIT_S = 180.0  # real seconds the drain may take before what is left counts as stuck
SIZE = re.compile(r"^\s*(?:(\d+)x)?(\d+(?:\.\d+)?)\s*(GiB|GB|MiB|TiB)\s*$", re.IGNORECASE)
UNITS = {"mib": 2**20, "gib": GIB, "gb": 10**9, "tib": 2**40}


# ---------------------------------------------------------------- the fleet's shape


@dataclass(frozen=True)
class Kind:
    """One kind of worker of the mix: ``cards`` cards of ``card_bytes`` each."""

    name: str
    cards: int
    card_bytes: int
    share: float


def parse_mix(text: str) -> list[Kind]:
    """``24GiB:0.6,80GiB:0.3,8x80GiB:0.1`` -> kinds; the shares are of cards, summing to 1."""
    kinds = []
    for part in text.split(","):
        size, _, share = part.rpartition(":")
        match = SIZE.match(size)
        if match is None or not share:
            raise ValueError(f"--mix: {part!r} is not SIZE:SHARE (e.g. 24GiB:0.6, 8x80GiB:0.1)")
        count, number, unit = match.groups()
        card_bytes = int(float(number) * UNITS[unit.lower()])
        kinds.append(Kind(size.strip(), int(count or 1), card_bytes, float(share)))
    total = sum(kind.share for kind in kinds)
    if not math.isclose(total, 1.0, abs_tol=0.01):
        raise ValueError(f"--mix: the shares sum to {total:g}, not 1")
    return kinds


def fleet_of(cards: int, kinds: list[Kind]) -> list[Kind]:
    """The workers of a fleet of about `cards` cards: each kind's share, at least one worker."""
    workers = []
    for kind in kinds:
        workers += [kind] * max(1, round(cards * kind.share / kind.cards))
    return workers


def footprint(u: float, options: Options) -> tuple[str, int]:
    """The trial's footprint class and bytes from its parameter u (see the module docstring)."""
    if u < options.infeasible_share:
        return "huge", FOOTPRINTS["huge"]
    if u < options.infeasible_share + options.handback_share:
        return "large", FOOTPRINTS["large"]
    return "small", FOOTPRINTS["small"]


def trial_minutes(rng: random.Random, mean: float) -> float:
    """A trial's length in simulated minutes: log-normal of mean `mean`, within 1 min - 4 h."""
    mu = math.log(mean) - SIGMA**2 / 2
    return min(MAX_TRIAL_MIN, max(MIN_TRIAL_MIN, rng.lognormvariate(mu, SIGMA)))


# ---------------------------------------------------------------- options and records


@dataclass
class Options:
    """One run of the simulator."""

    cards: int = 100
    mix: str = "24GiB:0.6,80GiB:0.3,8x80GiB:0.1"
    time_factor: float = 20.0
    trial_minutes: float = 10.0
    heartbeat_s: float = 10.0
    lease_ttl_s: float = 30.0  # the server's defaults, as the heartbeat's 10 s: simulated
    worker_stale_s: float = 30.0
    reaper_s: float = 2.0
    report_every_min: float = 5.0
    handback_share: float = 0.2
    infeasible_share: float = 0.02
    leave_per_hour: float = 0.05
    death_per_hour: float = 0.05
    warmup_min: float = 10.0
    window_min: float = 30.0
    database: str = "postgresql"
    replicas: int = 1
    seed: int = 48
    client_pool: int = 4  # connections of one worker

    def real(self, simulated_s: float) -> float:
        """Real seconds for simulated ones."""
        return simulated_s / self.time_factor


@dataclass
class Ledger:
    """What the clients saw: calls, final answers per trial, churn."""

    window: tuple[float, float] = (math.inf, math.inf)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)  # inside the window
    errors: Counter[str] = field(default_factory=Counter)
    finals: dict[int, list[tuple[str, str, str]]] = field(default_factory=dict)
    churn: Counter[str] = field(default_factory=Counter)
    lost_leases: int = 0
    alive: list[tuple[int, float, float | None]] = field(default_factory=list)  # cards, from, to
    trials_started: int = 0
    loop_lag: list[float] = field(default_factory=list)

    def in_window(self, at: float) -> bool:
        return self.window[0] <= at < self.window[1]

    def timed(self, name: str, began: float, took: float) -> None:
        if self.in_window(began):
            self.latencies.setdefault(name, []).append(took)
            self.calls[name] += 1

    def final(self, trial_id: int, lease: str, call: str, resolution: str) -> None:
        self.finals.setdefault(trial_id, []).append((lease, call, resolution))


class LeaseLost(Exception):
    """409: the trial is no longer this worker's."""


class Refused(Exception):
    """A 4xx other than 409."""


# ---------------------------------------------------------------- one simulated worker


class SimWorker:
    """One worker (a card, or a node of cards) speaking the agent's protocol."""

    def __init__(self, sim: Simulation, kind: Kind, number: int, http: httpx.AsyncClient) -> None:
        self.sim, self.kind, self.number, self.http = sim, kind, number, http
        self.id: int | None = None
        self.interval = sim.options.real(sim.options.heartbeat_s)
        self.held: set[int] = set()
        self.busy = 0  # cards running or planning a trial
        self.stop_orders: dict[int, str] = {}
        self.leaving = asyncio.Event()
        self.beat_now = asyncio.Event()
        self.rng = random.Random(sim.rng.random())
        self.first = True  # its first trial is under way already (see run_trial)

    # ------------------------------------------------------------ the calls

    async def call(self, name: str, method: str, path: str, body: Any = None, **params: Any) -> Any:
        """One call, retried on transport errors and 5xx (the agent's rule); the JSON answer,
        None for a 204; LeaseLost on 409, Refused on another 4xx."""
        ledger, delay = self.sim.ledger, 0.05
        while True:
            began = time.monotonic()
            try:
                answer = await self.http.request(
                    method, API + path, json=body, params=params or None
                )
            except httpx.TransportError as error:
                ledger.errors[f"{name}: {type(error).__name__}"] += 1
            else:
                idle = " (no work)" if answer.status_code == 204 else ""
                ledger.timed(name + idle, began, time.monotonic() - began)
                if answer.status_code < 300:
                    return None if answer.status_code == 204 else answer.json()
                if answer.status_code == 409:
                    ledger.errors[f"{name}: 409"] += 1
                    raise LeaseLost(answer.text)
                ledger.errors[f"{name}: {answer.status_code}"] += 1
                if answer.status_code < 500:
                    raise Refused(f"{name} {answer.status_code}: {answer.text[:300]}")
            await asyncio.sleep(random.uniform(0, delay))
            delay = min(delay * 2, 5.0)

    def card(self) -> dict[str, Any]:
        size = self.kind.card_bytes
        return {
            "model": f"Sim {self.kind.name}",
            "total_bytes": size,
            "free_bytes": size,
            "simulated": True,
            "torch_version": "sim",
        }

    async def register(self) -> None:
        card = self.card()
        body: dict[str, Any] = {
            "name": f"sim-{self.kind.name.lower()}-{self.number}",
            "device": "cpu" if self.kind.cards == 1 else "cuda:0",
            "card": card,
            "tasks": [TASK],
            "shape_params": {TASK: ["size"]},
            "slots": self.kind.cards,
        }
        if self.kind.cards > 1:
            body["cards"] = [{**card, "device_index": i} for i in range(self.kind.cards)]
        answer = await self.call("register", "POST", "/workers", body)
        self.id = int(answer["worker_id"])
        self.interval = float(answer["heartbeat_interval_s"])

    # ------------------------------------------------------------ its life

    async def live(self) -> None:
        """Register, heartbeat, run trials on every card; until it leaves or is cancelled."""
        await self.register()
        beats = asyncio.create_task(self.heartbeats())
        cards = [asyncio.create_task(self.run_card()) for _ in range(self.kind.cards)]
        try:
            await asyncio.gather(*cards)
        finally:
            beats.cancel()
        if self.leaving.is_set():
            with contextlib.suppress(LeaseLost, Refused):
                await self.call("stop", "POST", f"/workers/{self.id}/stop")

    async def heartbeats(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.beat_now.wait(), self.interval)
            self.beat_now.clear()
            body = {"free_bytes": self.free_bytes(), "trials": sorted(self.held)}
            try:
                answer = await self.call("heartbeat", "POST", f"/workers/{self.id}/heartbeat", body)
            except (LeaseLost, Refused):
                continue
            for order in answer["stop"]:
                self.stop_orders[order["trial_id"]] = order["reason"]

    def free_bytes(self) -> int:
        free_cards = self.kind.cards - self.busy
        return self.kind.card_bytes if free_cards > 0 else 0

    async def run_card(self) -> None:
        """One card's loop: ask, run, deliver; the next trial from complete's answer."""
        sim, following = self.sim, None
        while not self.leaving.is_set() and not sim.finished:
            assignment = following
            following = None
            if assignment is None:
                self.busy += 1
                body: dict[str, Any] = {"free_bytes": self.kind.card_bytes}
                if self.kind.cards > 1:
                    body["free_cards"] = self.kind.cards - self.busy + 1
                try:
                    assignment = await self.call("next", "POST", f"/workers/{self.id}/next", body)
                finally:
                    self.busy -= 1
            if assignment is None:
                await self.pause(IDLE_POLL_S, in_drain=True)
                continue
            self.busy += 1
            self.held.add(assignment["trial_id"])
            self.beat_now.set()  # the agent renews a new lease at once (Heartbeats.hold)
            try:
                following = await self.run_trial(assignment)
            except (LeaseLost, Refused):
                pass
            finally:
                self.held.discard(assignment["trial_id"])
                self.busy -= 1

    async def pause(self, simulated_s: float, in_drain: bool = False) -> bool:
        """Wait `simulated_s` (in the drain: no time, unless `in_drain`, an idle poll); True
        when the worker leaves meanwhile."""
        sim = self.sim
        seconds = sim.options.real(simulated_s)
        if sim.draining.is_set() and not in_drain:
            seconds = 0.0
        waits = [asyncio.ensure_future(self.leaving.wait())]
        if not in_drain:
            waits.append(asyncio.ensure_future(self.sim.draining.wait()))
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return self.leaving.is_set()

    async def run_trial(self, assignment: dict[str, Any]) -> dict[str, Any] | None:
        """Plan, run and deliver one trial; the next assignment when complete brought one."""
        sim, trial_id, lease = self.sim, assignment["trial_id"], assignment["lease"]
        study = assignment["study"]
        await self.call(
            "step_time",
            "GET",
            "/step-time",
            card_model=self.card()["model"],
            task=TASK,
            worker_id=self.id,
            study=study,
        )
        await self.call(
            "calibration",
            "GET",
            "/calibration",
            card_model=self.card()["model"],
            torch_version="sim",
            task=TASK,
            worker_id=self.id,
            study=study,
        )
        size, need = footprint(float(assignment["params"]["u"]), sim.options)
        prediction = {"peak_allocated_bytes": need, "peak_reserved_bytes": need, "method": "trace"}
        shared = bool(assignment["predictions"])
        made = (
            []
            if shared
            else [
                {"shape": {"size": size}, "plan": {"reason": "as asked"}, "prediction": prediction}
            ]
        )
        if need > self.kind.card_bytes * (1 - MARGIN):
            body = {
                "lease": lease,
                "min_footprint_bytes": need,
                "reason": "does not fit",
                "planning_s": 0.5,
                "predictions": made,
                "prediction_source": "fleet" if shared else "worker",
            }
            ack = await self.call("handback", "POST", f"/trials/{trial_id}/handback", body)
            sim.ledger.final(trial_id, lease, "handback", ack["resolution"])
            return None
        plan = {"reason": "as asked"}
        start = {
            "lease": lease,
            "plan": plan,
            "prediction": prediction,
            "planning_s": 0.5,
            "prediction_source": "fleet" if shared else "worker",
            "predictions": made,
        }
        await self.call("start", "POST", f"/trials/{trial_id}/start", start)
        sim.ledger.trials_started += 1
        minutes = trial_minutes(self.rng, sim.options.trial_minutes)
        if self.first:  # joined part-way through: the fleet's trials do not end in step
            minutes, self.first = max(0.1, minutes * self.rng.random()), False
        step, left = 0, minutes
        every = sim.options.report_every_min or math.inf
        while left > 0:
            chunk = min(left, every)
            if await self.pause(chunk * 60):
                await self.interrupted(trial_id, lease)
                return None
            left -= chunk
            if trial_id in self.stop_orders:
                return None  # lease lost (reaped): the agent drops the trial, no call
            if left > 0 and not sim.draining.is_set():
                step += 100
                report = {"lease": lease, "step": step, "value": self.rng.random()}
                await self.call("report", "POST", f"/trials/{trial_id}/report", report)
        values = [self.rng.random()]
        measured = {"peak_allocated_bytes": need, "peak_reserved_bytes": need}
        complete: dict[str, Any] = {
            "lease": lease,
            "values": values,
            "plan": plan,
            "prediction": prediction,
            "measured": measured,
            "duration_s": minutes * 60,
            "samples_per_s": 100.0,
            "step_time": {
                "batch_size": 32,
                "micro_batch": 32,
                "micro_batches": 1,
                "measured_step_s": 0.2 + self.rng.random() / 10,
                "predicted_step_s": 0.25,
            },
        }
        one_card = self.kind.cards == 1 and not self.leaving.is_set() and not sim.finished
        if one_card:
            complete["next"] = {"free_bytes": self.kind.card_bytes}
        ack = await self.call("complete", "POST", f"/trials/{trial_id}/complete", complete)
        sim.ledger.final(trial_id, lease, "complete", ack["resolution"])
        return ack.get("next")

    async def interrupted(self, trial_id: int, lease: str) -> None:
        body = {"lease": lease, "kind": "interrupted", "message": "the worker stopped"}
        ack = await self.call("fail", "POST", f"/trials/{trial_id}/fail", body)
        self.sim.ledger.final(trial_id, lease, "fail", ack["resolution"])


# ---------------------------------------------------------------- the simulation


class Simulation:
    """The fleet's clients, their churn and the phases of a run."""

    def __init__(self, options: Options, urls: list[str], budget: int) -> None:
        self.options, self.urls, self.budget = options, urls, budget
        self.rng = random.Random(options.seed)
        self.ledger = Ledger()
        self.draining = asyncio.Event()
        self.finished = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.spawned = 0
        self.client_of: Any = None  # url -> a worker's httpx.AsyncClient, set by run

    async def run(self, on_window: Any, is_done: Any) -> None:
        """Warm-up, window (``on_window(start)`` and ``on_window(end)``), drain until done."""
        options = self.options
        limits = httpx.Limits(max_connections=options.client_pool)
        # A client (connection pool) per worker, as each worker has its own: one pool for
        # hundreds of workers cost the simulator ~12 ms of CPU a request (httpcore matches
        # every queued request against every connection). One TLS context for them all.
        context = ssl.create_default_context()

        def client(url: str) -> httpx.AsyncClient:
            return httpx.AsyncClient(base_url=url, limits=limits, timeout=120, verify=context)

        self.client_of = client
        lag = asyncio.create_task(self.watch_loop())
        for number, kind in enumerate(fleet_of(options.cards, parse_mix(options.mix))):
            joins = self.rng.uniform(0, options.real(options.warmup_min * 60))
            self.spawn(kind, self.urls[number % len(self.urls)], joins)
        await asyncio.sleep(options.real(options.warmup_min * 60))
        began = time.monotonic()
        self.ledger.window = (began, began + options.real(options.window_min * 60))
        await on_window("start")
        await asyncio.sleep(options.real(options.window_min * 60))
        await on_window("end")
        self.draining.set()
        limit = time.monotonic() + DRAIN_LIMIT_S
        while time.monotonic() < limit and not await asyncio.to_thread(is_done):
            await asyncio.sleep(0.5)
        self.finished = True
        lag.cancel()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        end = time.monotonic()
        self.ledger.alive = [(c, a, end if b is None else b) for c, a, b in self.ledger.alive]

    def spawn(self, kind: Kind, url: str, after_s: float) -> None:
        self.spawned += 1
        task = asyncio.create_task(self.life(kind, self.spawned, url, after_s))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def life(self, kind: Kind, number: int, url: str, after_s: float) -> None:
        """One worker from join to leave or death; a worker of its kind joins after it."""
        async with self.client_of(url) as http:
            await self.lived(kind, number, http, url, after_s)

    async def lived(
        self, kind: Kind, number: int, http: httpx.AsyncClient, url: str, after_s: float
    ) -> None:
        options, ledger = self.options, self.ledger
        await asyncio.sleep(after_s)
        worker = SimWorker(self, kind, number, http)
        rate = options.leave_per_hour + options.death_per_hour
        ends_in = self.rng.expovariate(rate) * 3600 if rate > 0 else math.inf
        dies = self.rng.random() < options.death_per_hour / rate if rate > 0 else False
        alive = [kind.cards, time.monotonic(), None]
        index = len(ledger.alive)
        ledger.alive.append((kind.cards, alive[1], None))
        living = asyncio.create_task(worker.live())
        try:
            done, _ = await asyncio.wait([living], timeout=options.real(ends_in))
        except asyncio.CancelledError:  # the run ends: the worker with it
            living.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await living
            raise
        if not done and self.draining.is_set():  # no churn in the drain: it lives on
            with contextlib.suppress(Exception):
                await living
            done = {living}
        if done:
            if living.done() and living.exception() is not None:
                ledger.errors[f"worker: {type(living.exception()).__name__}"] += 1
            ledger.alive[index] = (kind.cards, alive[1], time.monotonic())
            return
        if dies:
            ledger.churn["deaths"] += 1
            living.cancel()  # no goodbye: it stops calling, mid-request or not
            with contextlib.suppress(asyncio.CancelledError):
                await living
        else:
            ledger.churn["leaves"] += 1
            worker.leaving.set()
            with contextlib.suppress(Exception):
                await living
        ledger.alive[index] = (kind.cards, alive[1], time.monotonic())
        if not self.draining.is_set():
            ledger.churn["joins"] += 1
            self.spawn(kind, url, options.real(JOIN_DELAY_MIN * 60))

    async def watch_loop(self) -> None:
        """How late the event loop wakes: the clients' own queueing, apart from the server's."""
        while True:
            began = time.monotonic()
            await asyncio.sleep(0.1)
            if self.ledger.in_window(began):
                self.ledger.loop_lag.append(time.monotonic() - began - 0.1)


# ---------------------------------------------------------------- server side


class CountedServer(ServerProcess):
    """`vramtune serve` through bench/fleet_statements.py: statements counted per call."""

    def __init__(self, database_url: str, log_path: Path, env: dict[str, str]) -> None:
        super().__init__(database_url, log_path, env)
        self.counts = log_path.with_suffix(".counts.json")

    def start(self) -> CountedServer:
        import subprocess

        command = [sys.executable, str(REPO / "bench" / "fleet_statements.py"), str(self.counts)]
        command += ["serve", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--database-url", self.database_url]
        path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env, "PYTHONPATH": path},
            )
        self._wait_healthy()
        return self

    def read_counts(self) -> dict[str, Counter[str]]:
        try:
            data = json.loads(self.counts.read_text())
        except (OSError, ValueError):
            return {"statements": Counter(), "commits": Counter(), "requests": Counter()}
        return {key: Counter(value) for key, value in data.items()}


def server_env(options: Options) -> dict[str, str]:
    """The server's settings, its protocol intervals divided by the time factor."""
    return {
        "VRAMTUNE_HEARTBEAT_INTERVAL_S": str(options.real(options.heartbeat_s)),
        "VRAMTUNE_LEASE_TTL_S": str(options.real(options.lease_ttl_s)),
        "VRAMTUNE_WORKER_STALE_S": str(options.real(options.worker_stale_s)),
        "VRAMTUNE_REAPER_INTERVAL_S": str(options.real(options.reaper_s)),
        "VRAMTUNE_MAX_WORKERS_PER_TOKEN": "1000000",
        "VRAMTUNE_LOG_LEVEL": "warning",
    }


def cpu_seconds(processes: list[psutil.Process]) -> dict[int, float]:
    """user + system CPU seconds of each process still there."""
    seconds = {}
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            seconds[process.pid] = times.user + times.system
    return seconds


def database_backends(url: str) -> list[psutil.Process]:
    """The PostgreSQL backends connected to the run's database now."""
    if not url.startswith("postgresql"):
        return []
    import psycopg

    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as connection:
        query = "SELECT pid FROM pg_stat_activity WHERE datname = %s"
        pids = [int(pid) for (pid,) in connection.execute(query, (url.rsplit("/", 1)[1],))]
    return [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


@contextlib.contextmanager
def database(kind: str, directory: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield upgrade_database(sqlite_url(directory))
        return
    with fresh_postgres_database() as url:
        yield upgrade_database(url)


def expected_trials(options: Options) -> int:
    """Trials the fleet runs in the warm-up and the window (each card, one after another)."""
    cards = sum(kind.cards for kind in fleet_of(options.cards, parse_mix(options.mix)))
    minutes = options.warmup_min + options.window_min
    return max(4, math.ceil(cards * minutes / options.trial_minutes))


def create_study(url: str, budget: int) -> None:
    spec = {
        "name": STUDY,
        "task": TASK,
        "search_space": {
            "u": {"type": "float", "low": 0.0, "high": 1.0},
            "x": {"type": "float", "low": -10.0, "high": 10.0},
        },
        "sampler": {"name": "random"},
        "pruner": {"name": "none"},
        "n_trials": budget,
        "max_attempts": 20,
        "budget": {"max_steps": 1000, "eval_every": 100},
    }
    answer = httpx.post(f"{url}{API}/studies", json=spec, timeout=60)
    answer.raise_for_status()


# ---------------------------------------------------------------- accounting


def account(url: str, budget: int, ledger: Ledger) -> dict[str, Any]:
    """Every trial finished once: from Optuna's rows, vramtune's, the leases, and the clients."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            study_id = connection.scalar(
                sa.text("SELECT study_id FROM studies WHERE study_name = :n"), {"n": STUDY}
            )
            states = Counter(
                dict(
                    connection.execute(
                        sa.text(
                            "SELECT state, count(*) FROM trials WHERE study_id = :s GROUP BY state"
                        ),
                        {"s": study_id},
                    ).all()
                )
            )
            optuna_state = dict(
                connection.execute(
                    sa.text("SELECT trial_id, state FROM trials WHERE study_id = :s"),
                    {"s": study_id},
                ).all()
            )
            rows = connection.execute(
                sa.text(
                    "SELECT trial_id, status, outcome, attempt FROM vramtune_trials "
                    "WHERE study_id = :s"
                ),
                {"s": study_id},
            ).all()
            leases = connection.execute(
                sa.text(
                    "SELECT l.trial_id, l.active, l.resolution FROM vramtune_leases l "
                    "JOIN vramtune_trials t ON t.trial_id = l.trial_id WHERE t.study_id = :s"
                ),
                {"s": study_id},
            ).all()
    finally:
        engine.dispose()
    states = Counter({getattr(k, "name", str(k)).split(".")[-1]: v for k, v in states.items()})
    optuna_state = {k: getattr(v, "name", str(v)).split(".")[-1] for k, v in optuna_state.items()}
    told_complete: Counter[int] = Counter()
    ended_by: Counter[str] = Counter()
    for trial_id, _active, how in leases:
        how = json.loads(how) if isinstance(how, str) else how or {}
        ended_by[str(how.get("call", "active"))] += 1
        if ((how.get("ack") or {}).get("resolution")) in ("complete", "infeasible", "failed"):
            told_complete[trial_id] += 1
    finished = {"COMPLETE", "FAIL", "PRUNED"}
    acked = {t for t, finals in ledger.finals.items() if any(r == "complete" for *_, r in finals)}
    # a trial acknowledged complete under two leases (a repeat under one lease is a replay)
    client_twice = sum(
        1
        for finals in ledger.finals.values()
        if len({lease for lease, _, resolution in finals if resolution == "complete"}) > 1
    )
    outcomes = Counter(str(outcome) for _, _, outcome, _ in rows)
    return {
        "budget": budget,
        "trials": len(optuna_state),
        "optuna_states": dict(states),
        "outcomes": dict(outcomes),
        "reoffered_attempts": sum(attempt for *_, attempt in rows),
        "leases_ended_by": dict(ended_by),
        "active_leases": sum(1 for _, active, _ in leases if active),
        # a trial acknowledged complete to a client that Optuna does not hold COMPLETE
        "lost": sum(1 for t in acked if optuna_state.get(t) != "COMPLETE")
        # a trial of the budget never asked
        + max(0, budget - len(optuna_state)),
        # a trial whose outcome was told under two leases, or acknowledged twice
        "duplicated": sum(1 for n in told_complete.values() if n > 1) + client_twice,
        # a trial not finished once the drain ended
        "stuck": sum(1 for state in optuna_state.values() if state not in finished)
        + sum(1 for _, status, _, _ in rows if status != "done"),
    }


# ---------------------------------------------------------------- one run


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run(options: Options) -> dict[str, Any]:
    """One run: database, server(s), study, the simulated fleet, the figures, the accounting."""
    # With room for the trials in flight when the window ends (up to two a card, one leased
    # ahead): a budget spent inside the window left the fleet polling for work.
    cards = sum(kind.cards for kind in fleet_of(options.cards, parse_mix(options.mix)))
    budget = math.ceil(expected_trials(options) * 1.3) + 2 * cards
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet_sim_")))
        url = stack.enter_context(database(options.database, directory))
        servers = []
        for index in range(options.replicas):
            server = CountedServer(url, directory / f"server-{index}.log", server_env(options))
            servers.append(server.start())
            stack.callback(server.stop)
        create_study(servers[0].url, budget)
        processes = [psutil.Process(s.process.pid) for s in servers if s.process is not None]
        marks: dict[str, Any] = {}

        async def on_window(which: str) -> None:
            backends = await asyncio.to_thread(database_backends, url)
            marks[which] = {
                "at": time.monotonic(),
                "server": cpu_seconds(processes),
                "database": cpu_seconds(backends),
                "client": time.process_time(),
                "counts": [s.read_counts() for s in servers],
                "load": loadavg(),
            }

        def is_done() -> bool:
            result = account(url, budget, Ledger())
            return result["stuck"] == 0 and result["trials"] >= budget

        simulation = Simulation(options, [s.url for s in servers], budget)
        began = time.monotonic()
        asyncio.run(simulation.run(on_window, is_done))
        wall = time.monotonic() - began
        accounting = account(url, budget, simulation.ledger)
        logs = [s.logs()[-3000:] for s in servers]
    return figures(options, simulation.ledger, marks, accounting, wall, logs)


def delta(after: Counter[str], before: Counter[str]) -> Counter[str]:
    return Counter({k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)})


def figures(
    options: Options,
    ledger: Ledger,
    marks: dict[str, Any],
    accounting: dict[str, Any],
    wall: float,
    logs: list[str],
) -> dict[str, Any]:
    """Per card-hour and per call, over the window."""
    start, end = marks["start"], marks["end"]
    w0, w1 = ledger.window
    card_s = sum(c * max(0.0, min(b, w1) - max(a, w0)) for c, a, b in ledger.alive)
    card_hours = card_s * options.time_factor / 3600
    server_cpu = sum(end["server"][pid] - start["server"].get(pid, 0.0) for pid in end["server"])
    database_cpu = sum(
        end["database"][pid] - start["database"].get(pid, 0.0) for pid in end["database"]
    )
    window_s = end["at"] - start["at"]
    statements: Counter[str] = Counter()
    commits: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    for before, after in zip(start["counts"], end["counts"], strict=True):
        statements += delta(after["statements"], before["statements"])
        commits += delta(after["commits"], before["commits"])
        requests += delta(after["requests"], before["requests"])
    by_call = {
        label: {
            "requests_per_card_hour": round(requests[label] / card_hours, 2),
            "statements_per_request": round(statements[label] / requests[label], 2)
            if requests[label]
            else None,
            "statements_per_card_hour": round(statements[label] / card_hours, 2),
            "commits_per_card_hour": round(commits[label] / card_hours, 2),
        }
        for label in sorted(set(statements) | set(requests))
    }
    latency = {
        name: {
            "n": len(values),
            "per_card_hour": round(len(values) / card_hours, 2),
            "p50_ms": round(percentile(values, 0.5) * 1000, 1),
            "p99_ms": round(percentile(values, 0.99) * 1000, 1),
        }
        for name, values in sorted(ledger.latencies.items())
    }
    service_cpu = server_cpu + database_cpu
    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "options": asdict(options),
        "workers": len(fleet_of(options.cards, parse_mix(options.mix))),
        "window_real_s": round(window_s, 1),
        "wall_s": round(wall, 1),
        "card_hours": round(card_hours, 2),
        "load": {"start": start["load"], "end": end["load"]},
        "cpu_s": {
            "server": round(server_cpu, 2),
            "database": round(database_cpu, 2),
            "clients": round(end["client"] - start["client"], 2),
        },
        "service_cores": round(service_cpu / window_s, 3),
        "cpu_s_per_card_hour": {
            "service": round(service_cpu / card_hours, 3),
            "server": round(server_cpu / card_hours, 3),
            "database": round(database_cpu / card_hours, 3),
        },
        "statements_per_card_hour": round(sum(statements.values()) / card_hours, 1),
        "commits_per_card_hour": round(sum(commits.values()) / card_hours, 1),
        "by_call": by_call,
        "latency": latency,
        "loop_lag_ms": {
            "p50": round(percentile(ledger.loop_lag, 0.5) * 1000, 1) if ledger.loop_lag else None,
            "p99": round(percentile(ledger.loop_lag, 0.99) * 1000, 1) if ledger.loop_lag else None,
        },
        "errors": dict(ledger.errors),
        "churn": dict(ledger.churn),
        "trials_started": ledger.trials_started,
        "accounting": accounting,
        "server_log_tail": [log[-1500:] for log in logs if "Traceback" in log],
    }


# ---------------------------------------------------------------- the report

TARGET_S = 1.0  # CPU-seconds of the service per card-hour (issue 48)
REPLICA_BUSY = 0.5  # of one core: what a server process is planned to use (one GIL each)
FLEETS = (1_000, 10_000, 100_000)


def key_of(result: dict[str, Any]) -> tuple[str, int, int, float]:
    options = result["options"]
    return options["database"], options["replicas"], options["cards"], options["time_factor"]


def sizing(result: dict[str, Any], database_per: float | None = None) -> list[dict[str, Any]]:
    """Cores, replicas and database for larger fleets, linear in the measured cost per card
    (the database's: `database_per`, CPU-s per card-hour, when given)."""
    per = result["cpu_s_per_card_hour"]
    rows = []
    for cards in FLEETS:
        server = cards * per["server"] / 3600
        database = cards * (per["database"] if database_per is None else database_per) / 3600
        rows.append(
            {
                "cards": cards,
                "server_cores": round(server, 2),
                "replicas": max(1, math.ceil(server / REPLICA_BUSY)),
                "database_cores": round(database, 2),
                "statements_per_s": round(cards * result["statements_per_card_hour"] / 3600),
                "commits_per_s": round(cards * result["commits_per_card_hour"] / 3600),
            }
        )
    return rows


def render(results: list[dict[str, Any]]) -> str:
    """The markdown report of every run kept in the JSON."""
    lines = [
        "# A fleet of simulated cards against the real service (bench/fleet_sim.py)",
        "",
        "Simulated cards (asyncio clients of the REST API, no torch) speak the worker's protocol "
        "to a real `vramtune serve` (one or two processes on one database): register, "
        "heartbeats, next, step-time and calibration reads, start, report, complete with next, "
        "hand-backs to larger cards, infeasible trials, and churn (joins, graceful leaves, "
        "abrupt deaths). Time runs `time factor` times faster, the server's heartbeat interval, "
        "lease TTL, worker_stale_s and reaper interval divided by the same factor. Costs are "
        "over the measurement window, per simulated card-hour; *service* is the server "
        "process(es) plus the run database's PostgreSQL backends (not the simulated clients, "
        "which share the machine). Load: the 1, 5 and 15-minute load averages at the window's "
        "start and end (2 cores).",
        "",
        "| database | replicas | cards (workers) | time factor | card-hours | service CPU s / "
        "card-hour (server + database) | service cores | statements / card-hour | lost / "
        "duplicated / stuck | churn (deaths, leaves) | load start → end |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        o, per, acc = r["options"], r["cpu_s_per_card_hour"], r["accounting"]
        churn = r["churn"]
        lines.append(
            f"| {o['database']} | {o['replicas']} | {o['cards']} ({r['workers']}) "
            f"| {o['time_factor']:g} | {r['card_hours']:.1f} "
            f"| **{per['service']:.3f}** ({per['server']:.3f} + {per['database']:.3f}) "
            f"| {r['service_cores']:.2f} | {r['statements_per_card_hour']:.0f} "
            f"| {acc['lost']} / {acc['duplicated']} / {acc['stuck']} "
            f"| {churn.get('deaths', 0)}, {churn.get('leaves', 0)} "
            f"| {r['load']['start']} → {r['load']['end']} |"
        )
    for r in results:
        o = r["options"]
        lines += [
            "",
            f"## {o['database']}, {o['replicas']} replica(s), {o['cards']} cards, "
            f"time factor {o['time_factor']:g}",
            "",
            f"Mix `{o['mix']}`, trials of {o['trial_minutes']:g} min on average (log-normal, "
            f"1 min to 4 h), heartbeats every {o['heartbeat_s']:g} s, reports every "
            f"{o['report_every_min']:g} min, hand-back share {o['handback_share']:g}, infeasible "
            f"share {o['infeasible_share']:g}, leaves {o['leave_per_hour']:g} and deaths "
            f"{o['death_per_hour']:g} per worker-hour; window {o['window_min']:g} simulated "
            f"min ({r['window_real_s']:g} s real), load {r['load']['start']} → "
            f"{r['load']['end']}. CPU over the window: server {r['cpu_s']['server']} s, "
            f"database {r['cpu_s']['database']} s, simulated clients {r['cpu_s']['clients']} s; "
            f"the clients' event loop woke late by {r['loop_lag_ms']['p50']} ms (p50), "
            f"{r['loop_lag_ms']['p99']} ms (p99), which the latencies below include.",
            "",
            "| call | calls / card-hour | p50 ms | p99 ms |",
            "|---|---|---|---|",
        ]
        for name, cell in r["latency"].items():
            lines.append(
                f"| {name} | {cell['per_card_hour']} | {cell['p50_ms']} | {cell['p99_ms']} |"
            )
        lines += [
            "",
            "| server call | requests / card-hour | statements / request | statements / card-hour "
            "| commits / card-hour |",
            "|---|---|---|---|---|",
        ]
        for label, cell in r["by_call"].items():
            lines.append(
                f"| `{label}` | {cell['requests_per_card_hour']} "
                f"| {cell['statements_per_request']} | {cell['statements_per_card_hour']} "
                f"| {cell['commits_per_card_hour']} |"
            )
        acc = r["accounting"]
        lines += [
            "",
            f"Accounting (database and Optuna, after the drain): budget {acc['budget']} trials, "
            f"{acc['trials']} asked; Optuna states {acc['optuna_states']}; outcomes "
            f"{acc['outcomes']}; leases ended by {acc['leases_ended_by']}; attempts re-offered "
            f"{acc['reoffered_attempts']}; **lost {acc['lost']}, duplicated "
            f"{acc['duplicated']}, stuck {acc['stuck']}**. Client errors: "
            f"{r['errors'] or 'none'}.",
        ]
        if acc["stuck"] or acc["lost"]:
            lines += [
                "",
                f"**The accounting did not pass: the drain did not end within {DRAIN_LIMIT_S:g} "
                "s.** Its trials still running or never asked count as stuck or lost here "
                "whatever the cause; the client errors above (timeouts) say whether the server "
                "was overloaded by the drain, which sends the rest of the budget through every "
                "worker with no time between calls.",
            ]
    chosen = sizing_basis(results)
    if chosen is not None:
        o = chosen["options"]
        lines += [
            "",
            "## On paper: 1,000, 10,000 and 100,000 cards",
            "",
            f"From the {o['database']} run of {o['cards']} cards, {o['replicas']} replica(s): "
            f"{chosen['cpu_s_per_card_hour']['server']:.3f} CPU-s of server and "
            f"{database_cost(results):.3f} of database per card-hour (the most any "
            "PostgreSQL run measured: backends a pool opens and closes inside the window are "
            "missed, so a busy run can undercount them), "
            f"{chosen['statements_per_card_hour']:.0f} statements per card-hour, taken as "
            f"linear in the cards. A replica (one process, one GIL) is planned at "
            f"{REPLICA_BUSY:g} of a core busy.",
            "",
            "| cards | server cores | replicas | database cores | statements / s | commits / s |",
            "|---|---|---|---|---|---|",
        ]
        for row in sizing(chosen, database_cost(results)):
            lines.append(
                f"| {row['cards']:,} | {row['server_cores']} | {row['replicas']} "
                f"| {row['database_cores']} | {row['statements_per_s']:,} "
                f"| {row['commits_per_s']:,} |"
            )
    return "\n".join(lines) + "\n"


def database_cost(results: list[dict[str, Any]]) -> float:
    """The database's CPU-s per card-hour to size by: the most any PostgreSQL run measured."""
    runs = [r for r in results if r["options"]["database"] == "postgresql"]
    return max((r["cpu_s_per_card_hour"]["database"] for r in runs), default=0.0)


def sizing_basis(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run the paper sizing starts from: the most cards on PostgreSQL, one replica."""
    runs = [r for r in results if r["options"]["database"] == "postgresql"] or results
    if not runs:
        return None
    return max(runs, key=lambda r: (r["options"]["cards"], -r["options"]["replicas"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Options()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=type(value), default=value, help=f"default {value}")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--name", default="fleet_sim", help="NAME.md and NAME.json in --out")
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite NAME.md from NAME.json, run nothing"
    )
    args = parser.parse_args(argv)
    path = args.out / f"{args.name}.json"
    if args.render_only:
        document = json.loads(path.read_text())
        write_report(args.out, args.name, document, render(document["runs"]))
        return 0
    options = Options(**{k: getattr(args, k) for k in asdict(defaults)})
    parse_mix(options.mix)  # refused before anything starts
    result = run(options)
    kept = json.loads(path.read_text())["runs"] if path.exists() else []
    runs = [r for r in kept if key_of(r) != key_of(result)] + [result]
    runs.sort(
        key=lambda r: (r["options"]["database"], r["options"]["replicas"], r["options"]["cards"])
    )
    basis = sizing_basis(runs)
    document = {"runs": runs, "sizing": sizing(basis, database_cost(runs)) if basis else []}
    write_report(args.out, args.name, document, render(runs))
    accounting = result["accounting"]
    print(
        f"lost {accounting['lost']}, duplicated {accounting['duplicated']}, "
        f"stuck {accounting['stuck']}; churn {result['churn']}"
    )
    clean = accounting["lost"] == accounting["duplicated"] == accounting["stuck"] == 0
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
