"""GET /metrics: Prometheus text that counts what the database holds, alike on every replica,
with latency histograms labelled by route template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from reliability_helpers import create_study

from vramtune.service.testing import ServerFactory, sqlite_url, upgrade_database
from vramtune.service.wire import API_PREFIX

FREE = 3 * 2**30


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(server_url: str) -> Samples:
    """Every sample of a scrape, keyed by (name, labels)."""
    response = httpx.get(f"{server_url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """One sample's value, None when absent."""
    return samples.get((name, frozenset(labels.items())))


DATABASE_GAUGES = (
    "vramtune_trials",
    "vramtune_trial_outcomes",
    "vramtune_trial_status",
    "vramtune_workers",
    "vramtune_worker_free_bytes",
    "vramtune_leases_active",
)


def from_database(samples: Samples) -> Samples:
    """The samples read from the database at scrape time."""
    return {key: v for key, v in samples.items() if key[0] in DATABASE_GAUGES}


def run_trials(client: httpx.Client, worker_id: int, outcomes: list[str]) -> None:
    """Lease, start and end one trial per outcome ('complete' or 'error')."""
    for outcome in outcomes:
        assignment: dict[str, Any] = client.post(
            f"/workers/{worker_id}/next", json={"free_bytes": FREE}
        ).json()
        trial, lease = assignment["trial_id"], assignment["lease"]
        assert client.post(f"/trials/{trial}/start", json={"lease": lease, "plan": {}}).is_success
        if outcome == "complete":
            body = {
                "lease": lease,
                "values": [1.5],
                "plan": {},
                "duration_s": 0.1,
                "measured": {"peak_allocated_bytes": 2**20},
            }
            assert client.post(f"/trials/{trial}/complete", json=body).is_success
        else:
            body = {"lease": lease, "kind": "error", "message": "boom"}
            assert client.post(f"/trials/{trial}/fail", json=body).is_success


def test_metrics_count_the_database_alike_on_two_replicas(
    tmp_path: Path, start_server: ServerFactory
) -> None:
    """Trial states and outcomes, live workers and free memory, leases, per-route latencies."""
    url = upgrade_database(sqlite_url(tmp_path))
    # The lease and the worker stay live however slow the machine is ("live" labels below).
    patient = {"lease_ttl_s": 3600, "worker_stale_s": 3600}
    server, replica = start_server(url, **patient), start_server(url, **patient)
    study = create_study(server.url, n_trials=10)
    card = {"model": "test-card", "total_bytes": 4 * 2**30, "free_bytes": FREE, "simulated": True}
    with httpx.Client(base_url=server.url + API_PREFIX, timeout=60) as client:
        worker = client.post(
            "/workers", json={"name": "w1", "device": "cpu", "card": card, "tasks": ["quadratic"]}
        ).json()["worker_id"]
        run_trials(client, worker, ["complete", "complete", "error"])
        client.post(f"/workers/{worker}/next", json={"free_bytes": FREE})  # holds a lease now

    samples = scrape(server.url)

    assert value(samples, "vramtune_trials", study=study, state="COMPLETE") == 2
    assert value(samples, "vramtune_trials", study=study, state="FAIL") == 1
    # RUNNING in Optuna: the trial leased now, and those the server asked ahead (queued).
    running = value(samples, "vramtune_trials", study=study, state="RUNNING")
    assert value(samples, "vramtune_trial_status", status="leased") == 1
    pending = value(samples, "vramtune_trial_status", status="pending") or 0
    assert running == 1 + pending
    assert value(samples, "vramtune_trial_outcomes", study=study, outcome="as_asked") == 2
    assert value(samples, "vramtune_trial_outcomes", study=study, outcome="failed") == 1
    assert value(samples, "vramtune_workers", state="live") == 1
    worker_labels = {"worker_id": str(worker), "worker": "w1", "card_model": "test-card"}
    assert value(samples, "vramtune_worker_free_bytes", **worker_labels) == FREE
    assert value(samples, "vramtune_leases_active", expiry="live") == 1
    assert value(samples, "vramtune_database_up") == 1
    next_route = f"{API_PREFIX}/workers/{{worker_id}}/next"
    count = "vramtune_http_request_duration_seconds_count"
    assert value(samples, count, method="POST", route=next_route, status="200") == 4
    routes = {dict(labels)["route"] for name, labels in samples if name == count}
    assert not [r for r in routes if f"/workers/{worker}/" in r or "/trials/1" in r], routes

    on_replica = scrape(replica.url)
    assert from_database(on_replica) == from_database(samples)  # replicas agree
    assert value(on_replica, count, method="POST", route=next_route, status="200") is None
