"""Server-side faults: the server killed and restarted, two replicas on one PostgreSQL, and the
database unreachable for a while."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from reliability_helpers import (
    FAST_FLEET,
    PATIENCE_S,
    Fleet,
    LeaseAuditor,
    TcpProxy,
    assert_accounted,
    completed_by_workers,
    create_study,
    json_events,
    read_outcome,
    wait_for_budget,
    wait_for_finished,
)
from sqlalchemy import make_url

from vramtune.service.testing import ServerFactory, ServerProcess, sqlite_url, upgrade_database
from vramtune.service.wire import API_PREFIX

# A lease outlives the server's restart below, so a worker's result is delivered, not re-run.
PATIENT_FLEET = {**FAST_FLEET, "lease_ttl_s": 30.0, "worker_stale_s": 30.0}
OUTAGE_S = 5.0
# Leases shorter than the database outage (heartbeats often enough that a loaded machine does
# not lose one otherwise): they live on because expiry counts only time the database was seen.
OUTAGE_FLEET = {**FAST_FLEET, "lease_ttl_s": 3.0, "heartbeat_interval_s": 0.5}


def test_server_killed_and_restarted_loses_nothing(
    postgres_url: str, start_server: ServerFactory, fleet: Fleet
) -> None:
    """kill -9 the server mid-study, start it on the same database: workers carry on."""
    url = upgrade_database(postgres_url)
    server = start_server(url, **PATIENT_FLEET)
    n_trials = 32
    study = create_study(server.url, n_trials, step_seconds=0.02)
    fleet.start(server.url, 8)
    before = wait_for_finished(url, study, n_trials // 3)

    server.kill()
    time.sleep(2.0)  # workers meet a dead server and back off
    server.start()
    outcome = wait_for_budget(url, study, n_trials)
    gave_up = [w.name for w in fleet.workers if not w.alive()]
    fleet.stop_all()

    assert gave_up == [], "a worker gave up on the restarted server"
    assert_accounted(outcome, n_trials)
    assert outcome.states() == {"COMPLETE": n_trials}
    after = {t._trial_id: t for t in outcome.trials}
    for trial in before.trials:
        if trial.state.name == "COMPLETE":  # a completed trial is never lost nor re-run
            assert after[trial._trial_id].values == trial.values
            assert outcome.rows[trial._trial_id].attempt == 0
    assert set(completed_by_workers(fleet.events()).values()) == {1}


def test_results_finished_while_the_server_was_down_are_accepted_after_a_restart(
    postgres_url: str, start_server: ServerFactory, fleet: Fleet
) -> None:
    """kill -9 the server while workers run trials, start it again after 1.5 lease TTLs: the
    leases expired meanwhile, yet every result finished during the downtime is accepted once
    and no trial runs twice (the reaper expires no lease within a TTL of the restart)."""
    url = upgrade_database(postgres_url)
    server = start_server(url, **FAST_FLEET)
    n_trials = 24
    # No intermediate reports: a worker whose run ends while the server is down holds its result.
    study = create_study(server.url, n_trials, step_seconds=0.05, reports=False)
    fleet.start(server.url, 6)
    wait_for_finished(url, study, 6)
    fleet.wait_for_busy(3)  # killed while runs are under way, each ends within the downtime

    server.kill()
    time.sleep(1.5 * FAST_FLEET["lease_ttl_s"])
    server.start()
    outcome = wait_for_budget(url, study, n_trials)
    fleet.stop_all()

    events = fleet.events()
    queued = {e["trial_id"] for e in events if e["event"] == "result_queued"}
    assert queued, "no worker held a result while the server was down: the test tested nothing"
    delivered = {e["trial_id"]: e["resolution"] for e in events if e["event"] == "delivered"}
    assert {t: delivered.get(t) for t in queued} == dict.fromkeys(queued, "complete")
    leased = Counter(e["trial_id"] for e in events if e["event"] == "leased")
    assert set(leased.values()) == {1}, f"re-run: {[t for t, n in leased.items() if n > 1]}"
    for trial_id in queued:  # one lease, ended by the result it held, never by the reaper
        ends = [(lease.resolution or {}).get("call") for lease in outcome.leases[trial_id]]
        assert ends == ["complete"], f"trial {trial_id}: leases ended {ends}"
    assert all(row.attempt == 0 for row in outcome.rows.values()), "a result was re-run"
    assert_accounted(outcome, n_trials)
    assert outcome.states() == {"COMPLETE": n_trials}
    assert set(completed_by_workers(events).values()) == {1}


def test_two_replicas_never_assign_a_trial_twice(
    postgres_url: str, start_server: ServerFactory, fleet: Fleet
) -> None:
    """Two servers on one PostgreSQL, half the fleet on each: one lease per trial, the budget
    exactly, each trial told once."""
    url = upgrade_database(postgres_url)
    replicas = [start_server(url, **PATIENT_FLEET) for _ in range(2)]
    n_trials = 48
    study = create_study(replicas[0].url, n_trials)
    with LeaseAuditor(url) as auditor:
        for _ in range(16):  # alternately, so that neither replica's half starts first
            for replica in replicas:
                fleet.start_one(replica.url)
        outcome = wait_for_budget(url, study, n_trials)
    fleet.stop_all()

    assert auditor.polls > 0 and auditor.doubles == [], f"two active leases: {auditor.doubles}"

    assert_accounted(outcome, n_trials)  # leases of a trial follow one another; told once
    assert outcome.states() == {"COMPLETE": n_trials}
    assigned = Counter(e["trial_id"] for e in fleet.events() if e["event"] == "leased")
    assert set(assigned) == {t._trial_id for t in outcome.trials}
    for trial_id, leases in outcome.leases.items():
        # More than one lease only after a lost one (a heartbeat too late on a loaded machine).
        assert assigned[trial_id] == len(leases), f"trial {trial_id}: assigned {assigned[trial_id]}"
        assert all((lease.resolution or {}).get("call") == "reaper" for lease in leases[:-1])
    by_replica = {
        replica.url: {
            e["trial_id"] for w in fleet.workers[i::2] for e in w.events() if e["event"] == "leased"
        }
        for i, replica in enumerate(replicas)
    }
    assert all(by_replica.values()), "one replica handed out no trial: nothing was shared"


def statuses_during(server_url: str, worker_id: int, study: str, seconds: float) -> set[int]:
    """Status codes of health, next-trial and study reads made while the database is away."""
    seen = set()
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=server_url + API_PREFIX, timeout=20) as client:
        while time.monotonic() < deadline:
            seen.add(client.get("/health").status_code)
            seen.add(client.post(f"/workers/{worker_id}/next", json={"free_bytes": 1}).status_code)
            seen.add(client.get(f"/studies/{study}").status_code)
            time.sleep(0.2)
    return seen


def register_probe(server_url: str) -> int:
    """A worker that only asks questions (it runs nothing and advertises no study's task)."""
    card = {"model": "probe", "total_bytes": 1, "free_bytes": 1, "simulated": True}
    body = {"name": "probe", "device": "cpu", "card": card, "tasks": ["no-such-task"]}
    response = httpx.post(f"{server_url}{API_PREFIX}/workers", json=body, timeout=30)
    assert response.status_code == 201, response.text
    return int(response.json()["worker_id"])


def test_database_outage_is_503_and_results_wait_for_its_return(
    postgres_url: str,
    tcp_proxy: Callable[[str, int], TcpProxy],  # first: torn down last, after the workers
    start_server: ServerFactory,
    fleet: Fleet,
) -> None:
    """The database cut off for longer than a lease lives: 503s (never 500), the server
    recovers by itself, and the results workers finished meanwhile are delivered afterwards
    (not lost, not refused, no trial run twice)."""
    url = upgrade_database(postgres_url)
    target = make_url(url)
    proxy = tcp_proxy(target.host or "127.0.0.1", target.port or 5432)
    proxied = target.set(port=proxy.port).render_as_string(hide_password=False)
    server = start_server(proxied, **OUTAGE_FLEET)
    n_trials = 32
    # No intermediate reports: a worker whose run ends during the outage holds its result.
    study = create_study(server.url, n_trials, step_seconds=0.05, reports=False)
    probe = register_probe(server.url)
    fleet.start(server.url, 8)
    wait_for_finished(url, study, 8)
    # Cut while runs are under way (each ends well within the outage), so that some result
    # meets the outage: a loaded machine once cut between runs and the test tested nothing.
    fleet.wait_for_busy(3)

    proxy.cut()
    during = statuses_during(server.url, probe, study, OUTAGE_S)
    proxy.restore()
    outcome = wait_for_budget(url, study, n_trials)
    fleet.stop_all()

    assert during == {503}, f"answers while the database was away: {during}"
    assert_accounted(outcome, n_trials)
    assert outcome.states() == {"COMPLETE": n_trials}
    assert all(row.attempt == 0 for row in outcome.rows.values()), "a result was re-run"
    events = fleet.events()
    leased = Counter(e["trial_id"] for e in events if e["event"] == "leased")
    assert set(leased.values()) == {1}, f"ran twice: {[t for t, n in leased.items() if n > 1]}"
    queued = {e["trial_id"] for e in events if e["event"] == "result_queued"}
    assert queued, "no worker had a result to keep during the outage: the test tested nothing"
    delivered = {e["trial_id"] for e in events if e["event"] == "delivered"}
    assert queued <= delivered, f"kept, never delivered: {queued - delivered}"
    values = {t._trial_id: t.values for t in outcome.trials}
    for event in events:  # what was kept is what Optuna holds, told once
        if event["event"] == "completed" and event["trial_id"] in queued:
            assert values[event["trial_id"]] == event["values"]
            assert event["resolution"] == "complete"
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert 'status="503"' in metrics
    assert 'status="500"' not in metrics


def behind_a_proxy(
    postgres_url: str,
    tcp_proxy: Callable[[str, int], TcpProxy],
    start_server: ServerFactory,
    **env: object,
) -> tuple[ServerProcess, TcpProxy]:
    """A server logging JSON on a migrated PostgreSQL it reaches through a proxy to cut."""
    target = make_url(upgrade_database(postgres_url))
    proxy = tcp_proxy(target.host or "127.0.0.1", target.port or 5432)
    proxied = target.set(port=proxy.port).render_as_string(hide_password=False)
    return start_server(proxied, log_format="json", **env), proxy


def test_a_database_outage_logs_one_line_a_pass_and_one_when_it_is_back(
    postgres_url: str,
    tcp_proxy: Callable[[str, int], TcpProxy],
    start_server: ServerFactory,
) -> None:
    """While the database is away each reaper pass logs one line (what failed, since when),
    no traceback; its return is one line."""
    server, proxy = behind_a_proxy(postgres_url, tcp_proxy, start_server, reaper_interval_s=0.3)

    proxy.cut()
    time.sleep(3.0)
    proxy.restore()
    back = wait_for_log_event(server, "database_back")
    server.stop()

    lines = server.logs().splitlines()
    assert not any("Traceback" in line for line in lines), server.logs()[-4000:]
    events = json_events(server.log_path)
    names = [e["event"] for e in events]
    first_failure = names.index("reaper_pass_failed")
    during = events[first_failure : names.index("database_back")]
    assert len(during) >= 2, names  # several passes failed, each said so
    assert {e["event"] for e in during} == {"reaper_pass_failed"}, names
    assert len({e["failing_since"] for e in during}) == 1  # since when: the outage's start
    assert all(e["error"].startswith("OperationalError: ") for e in during), during[0]
    assert back["failing_since"] == during[0]["failing_since"] and back["outage_s"] > 0
    assert names.count("database_back") == 1


def test_requests_during_an_outage_log_one_line_each(
    postgres_url: str,
    tcp_proxy: Callable[[str, int], TcpProxy],
    start_server: ServerFactory,
) -> None:
    """A request the database fails logs one warning line (where, the request, the error's
    first line), not the driver's multi-line text: one per request during an outage."""
    server, proxy = behind_a_proxy(postgres_url, tcp_proxy, start_server, reaper_interval_s=3600)

    proxy.cut()
    studies = httpx.get(f"{server.url}{API_PREFIX}/studies", timeout=60)
    metrics = httpx.get(f"{server.url}/metrics", timeout=60)
    proxy.restore()
    server.stop()

    assert studies.status_code == 503, studies.text
    assert "vramtune_database_up 0.0" in metrics.text
    lines = server.logs().splitlines()
    assert not any("Traceback" in line for line in lines), server.logs()[-4000:]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    warnings = [r for r in records if r["level"] in ("WARNING", "ERROR")]
    assert warnings and not [r for r in warnings if "\n" in r.get("message", "")], warnings
    outages = [e for e in json_events(server.log_path) if e["event"] == "database_unavailable"]
    assert {e["where"] for e in outages} >= {"metrics scrape"}, outages
    [request] = [e for e in outages if e.get("path") == f"{API_PREFIX}/studies"]
    assert request["method"] == "GET" and request["where"] in ("request", "optuna storage")
    for event in outages:
        assert event["level"] == "WARNING" and "\n" not in event["error"], event
        assert event["error"].split(": ", 1)[0].endswith("Error"), event  # its type, first


def wait_for_log_event(server: ServerProcess, name: str) -> dict[str, Any]:
    """The first event of that name in the server's JSON log, waiting for it."""
    deadline = time.monotonic() + PATIENCE_S
    while not (found := [e for e in json_events(server.log_path) if e["event"] == name]):
        assert time.monotonic() < deadline, f"no {name!r} logged:\n{server.logs()[-4000:]}"
        time.sleep(0.2)
    return found[0]


def test_a_lease_whose_answer_was_lost_is_not_held_forever(
    tmp_path: Path, start_server: ServerFactory
) -> None:
    """A next answered but not heard, then the worker heartbeats (naming the trials it runs:
    none) and asks again: the trial of the lost answer is offered again to it, or its lease
    ends; never held by nobody."""
    url = upgrade_database(sqlite_url(tmp_path))
    # Heartbeats far more often than the lease lives: a loaded machine cannot make it expire.
    server = start_server(url, lease_ttl_s=6.0, heartbeat_interval_s=0.3, reaper_interval_s=0.3)
    study = create_study(server.url, 4)
    card = {"model": "c", "total_bytes": 2**30, "free_bytes": 2**30, "simulated": True}
    body = {"name": "deaf", "device": "cpu", "card": card, "tasks": ["quadratic"]}
    with httpx.Client(base_url=server.url + API_PREFIX, timeout=30) as client:
        worker = client.post("/workers", json=body).json()["worker_id"]
        lost = client.post(f"/workers/{worker}/next", json={"free_bytes": 2**30}).json()
        alive_until = time.monotonic() + 8.0  # longer than the lease lives
        while time.monotonic() < alive_until:
            beat = client.post(f"/workers/{worker}/heartbeat", json={"trials": []})
            assert beat.status_code == 200
            time.sleep(0.3)
        again = client.post(f"/workers/{worker}/next", json={"free_bytes": 2**30}).json()

    leases = read_outcome(url, study).leases[lost["trial_id"]]
    assert again["trial_id"] == lost["trial_id"] or not leases[0].active
