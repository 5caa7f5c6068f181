"""The worker's side of faults, seen in its structured logs: JSON lines of a real server and
worker run, and results kept on disk (--spool) across a kill -9 while the server was away."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

from reliability_helpers import (
    FAST_FLEET,
    Fleet,
    TcpProxy,
    assert_accounted,
    create_study,
    json_events,
    wait_for_budget,
)

from vramtune.service.testing import ServerFactory, sqlite_url, upgrade_database


def test_server_and_worker_write_json_lines_with_trial_and_worker_ids(
    tmp_path: Path, start_server: ServerFactory, fleet: Fleet
) -> None:
    """--log-format json: every server line is a JSON object; the reaper's and the workers'
    events name the trial and the worker."""
    url = upgrade_database(sqlite_url(tmp_path))
    # Three workers only: leases of 3 s renewed twice a second, so the kill is reaped quickly.
    quick = {**FAST_FLEET, "lease_ttl_s": 3.0, "heartbeat_interval_s": 0.5}
    server = start_server(url, log_format="json", access_log="true", **quick)
    n_trials = 6
    study = create_study(server.url, n_trials, step_seconds=0.05)
    fleet.start(server.url, 2)
    victim, trial_id = fleet.kill_busy(random.Random(3))  # so that the reaper has work
    fleet.start(server.url, 1)
    outcome = wait_for_budget(url, study, n_trials)
    fleet.stop_all()
    server.stop()

    assert_accounted(outcome, n_trials)
    lines = [line for line in server.logs().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line, uvicorn's too
    assert all(isinstance(r, dict) and {"time", "level", "logger"} <= set(r) for r in records)
    assert any("/next" in r.get("message", "") for r in records), "no access log line"
    reaped = [r for r in records if r.get("event") == "lease_reaped"]
    (killed,) = [r for r in reaped if r["worker_id"] == victim.worker_id()]
    assert killed["trial_id"] == trial_id and killed["then"] == "reoffered"
    assert killed["logger"] == "vramtune.reaper"

    events = fleet.events()
    for name in ("leased", "started", "completed"):
        seen = [e for e in events if e["event"] == name]
        assert all({"trial_id", "number", "study", "worker", "worker_id"} <= set(e) for e in seen)
        assert all(e["study"] == study for e in seen)
    completed = {e["trial_id"] for e in events if e["event"] == "completed"}
    assert completed == {t._trial_id for t in outcome.trials}
    for worker in fleet.workers[1:]:  # those that exited by themselves: JSON lines only
        assert all(isinstance(json.loads(line), dict) for line in worker.logs().splitlines())


def test_a_result_kept_in_the_spool_survives_kill_9_while_the_server_is_away(
    tmp_path: Path,
    tcp_proxy: Callable[[str, int], TcpProxy],
    start_server: ServerFactory,
    fleet: Fleet,
) -> None:
    """The server unreachable when a trial ends, the worker SIGKILLed: its next run delivers
    the result from the spool (not re-run), and a replay of an answered call gets the stored
    answer (told once)."""
    url = upgrade_database(sqlite_url(tmp_path))
    server = start_server(url, **{**FAST_FLEET, "lease_ttl_s": 120.0, "worker_stale_s": 120.0})
    proxy = tcp_proxy("127.0.0.1", server.port)
    through = f"http://127.0.0.1:{proxy.port}"
    # One trial of ~6 s without intermediate reports: it ends while the proxy is cut.
    study = create_study(server.url, 1, step_seconds=0.3, reports=False)
    spool = tmp_path / "spool"
    first = fleet.start_one(through, "--spool", str(spool))
    first.wait_for_event("started")
    proxy.cut()
    queued = first.wait_for_event("result_queued")
    (kept,) = spool.glob("*.json")
    assert queued["spool"] == str(kept) and queued["call"] == "complete"
    body = json.loads(kept.read_text())["body"]
    first.process.kill()
    first.process.wait()
    copy = shutil.copy(kept, tmp_path / kept.name)
    proxy.restore()

    second = fleet.start_one(through, "--spool", str(spool))
    outcome = wait_for_budget(url, study, 1)
    delivered = second.wait_for_event("delivered")
    assert list(spool.glob("*.json")) == []
    again = tmp_path / "spool-again"
    again.mkdir()
    shutil.move(copy, again / kept.name)
    third = fleet.start_one(server.url, "--spool", str(again))
    replayed = third.wait_for_event("delivered")
    fleet.stop_all()

    (trial,) = outcome.trials
    assert delivered["replayed"] is True and delivered["trial_id"] == trial._trial_id
    assert delivered["resolution"] == "complete"
    assert trial.state.name == "COMPLETE" and trial.values == body["values"]
    assert outcome.rows[trial._trial_id].attempt == 0, "the result was re-run, not delivered"
    (lease,) = outcome.leases[trial._trial_id]
    assert (lease.resolution or {}).get("call") == "complete"
    assert replayed["resolution"] == "complete"  # the stored answer of the first delivery
    assert [e["event"] for e in json_events(third.log_path)].count("leased") == 0
    assert wait_for_budget(url, study, 1).states() == {"COMPLETE": 1}
