"""Multi-GPU trials end to end: a 4-rank CPU node worker beside a 1-card worker (real server,
real `vramtune worker` processes, SQLite and PostgreSQL).

digits-cnn at width 16, resolution 32 on 12 MiB simulated cards (10 % margin: 11.3 MB a card),
as predicted here: batch 16 needs 5.2 MB (one card), 64 needs 20.3 MB (2 ranks of DDP: 10.3 MB
each), 128 needs 40.5 MB (4 ranks: 10.3 MB each; 2 ranks need 20.4 MB), 256 needs 10.2 MB on each
of 8 ranks, which no node has: infeasible. Resizing is off, so only more cards can hold a trial.
The node runs a one-card and a 2-rank trial at once on disjoint cards (both endless, both
reporting: their overlap is seen, not timed); SIGTERM stops both, and a rank's fault ends its own
trial only.

Cost: several minutes on two loaded cores (each distributed trial spawns its ranks, which import
torch), per database.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Studies, WorkerFactory, WorkerProcess, finished
from vramtune.service.testing import ServerProcess

# Distributed trials spawn processes that import torch: minutes each at the loads seen here (30).
pytestmark = pytest.mark.timeout(1800)
CARD = "12MiB"
BATCHES = (16, 64, 128, 256)
SLOW_S = 900.0  # a failure bound for a study of distributed trials on a loaded machine
DIGITS = ("--tasks", "vramtune.worker.tasks.digits")
SPEC: dict[str, Any] = {
    "task": "digits-cnn",
    "task_config": {"width": 16, "depth": 2, "resolution": 32},
    "budget": {"max_steps": 2, "eval_every": 2},
    "memory_policy": {"allow_resize": False},
    "distributed": {"strategies": ["ddp", "fsdp"], "max_world_size": 8},
}


def _batches(*sizes: int) -> dict[str, Any]:
    return {"batch_size": {"type": "categorical", "choices": list(sizes)}}


def test_large_trials_run_on_the_fewest_ranks_and_one_no_node_holds_is_infeasible(
    fleet_server: ServerProcess, start_worker: WorkerFactory, studies: Studies
) -> None:
    node = start_worker(fleet_server.url, CARD, *DIGITS, "--ranks", "4")
    card = start_worker(fleet_server.url, CARD, *DIGITS)
    for worker in (node, card):
        worker.wait_for('"event": "registered"')
    # One study per batch size: each configuration exactly once (a grid study on PostgreSQL
    # once sampled one size twice and 256 never, with two workers asking at once).
    names = {batch: studies.create(_batches(batch), **SPEC, n_trials=1) for batch in BATCHES}
    by_batch = {
        batch: studies.wait_until(name, finished(1), timeout=SLOW_S)[0]
        for batch, name in names.items()
    }
    trials = list(by_batch.values())
    assert all(t.state == "COMPLETE" for t in trials), [(t.params, t.outcome) for t in trials]
    assert by_batch[16].plan is not None and by_batch[16].plan.world_size == 1
    for batch, ranks in ((64, 2), (128, 4)):
        trial = by_batch[batch]
        assert trial.worker == node.name
        assert trial.plan is not None and trial.plan.world_size == ranks
        assert trial.plan.strategy == "ddp"  # DDP before FSDP2 when both fit
        assert f"{ranks} ranks, ddp" in trial.plan.reason
        assert trial.rank_peak_bytes is not None and len(trial.rank_peak_bytes) == ranks
        assert trial.predicted_peak_bytes is not None
        # Rank 0's measured peak against its prediction (to the byte in bench/results).
        assert trial.rank_peak_bytes[0] == pytest.approx(trial.predicted_peak_bytes, rel=0.01)
        assert trial.attempt == 0  # ran once
    infeasible = by_batch[256]
    assert infeasible.outcome == "infeasible"
    assert "8 cards" in infeasible.user_attrs["vramtune.fail_reason"]
    started = sum(w.logs().count('"event": "started"') for w in (node, card))
    assert started == 3  # batches 16, 64 and 128, each once


def test_a_node_runs_two_trials_at_once_on_disjoint_cards_and_sigterm_gives_both_back(
    fleet_server: ServerProcess, start_worker: WorkerFactory, studies: Studies
) -> None:
    node = start_worker(fleet_server.url, CARD, *DIGITS, "--ranks", "4")
    node.wait_for('"event": "slots_ready"')
    slot = _spawned(node)  # the node's one-card trial process, started with its loop
    endless = {"max_steps": 10**6, "eval_every": 1}  # a value every step: it trains
    one_card = studies.create(_batches(16), **{**SPEC, "budget": endless}, n_trials=1)
    two_ranks = studies.create(_batches(64), **{**SPEC, "budget": endless}, n_trials=1)
    for name in (one_card, two_ranks):
        studies.wait_until(name, lambda ts: bool(ts) and bool(ts[0].intermediate), timeout=SLOW_S)
    # Both train at once (neither ends by itself), on the node's one card and two of the
    # three left; the fleet page counts 1 + 2 of its 4 cards.
    [first], [second] = studies.trials(one_card), studies.trials(two_ranks)
    assert first.plan is not None and first.plan.world_size == 1
    assert second.plan is not None and second.plan.world_size == 2
    one, two = set(first.user_attrs["vramtune.cards"]), set(second.user_attrs["vramtune.cards"])
    assert len(one) == 1 and len(two) == 2 and not one & two, (one, two)
    assert _busy_cards(fleet_server.url, node) == 3
    ranks = _ranks(node, slot)
    assert len(ranks) == 2
    node.signal(signal.SIGTERM)
    assert node.wait(timeout=SLOW_S) == 0
    for name in (one_card, two_ranks):
        [trial] = studies.trials(name)
        assert trial.state == "RUNNING" and trial.attempt == 0  # offered again, not failed
    assert node.logs().count('"kind": "interrupted"') == 2
    assert not [pid for pid in ranks if _running(pid)]  # no rank outlives its trial


def _running(pid: int) -> bool:
    """Whether the process is alive (a zombie is dead, only not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _busy_cards(server: str, node: WorkerProcess) -> int:
    """The node's busy cards, as the fleet page shows them."""
    response = httpx.get(f"{server}/api/v1/dashboard/fleet", params={"limit": 500}, timeout=30)
    [busy] = [w["busy_cards"] for w in response.json()["workers"] if w["name"] == node.name]
    return int(busy)


def _ranks(worker: WorkerProcess, slot: list[int]) -> list[int]:
    """The worker's rank processes: what it spawned, less its one-card trial process."""
    return [pid for pid in _spawned(worker) if pid not in slot]


def _spawned(worker: WorkerProcess) -> list[int]:
    """The worker's spawned processes (multiprocessing's spawn children): its ranks, and its
    one-card trial process (vramtune/worker/loop/node.py)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # gone while we looked
            continue
        alive = fields[0] != "Z"  # a zombie is dead, only not reaped yet
        if alive and int(fields[1]) == worker.process.pid and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def test_a_rank_killed_mid_trial_fails_its_trial_once_and_leaves_no_rank(
    fleet_server: ServerProcess, start_worker: WorkerFactory, studies: Studies
) -> None:
    node = start_worker(fleet_server.url, CARD, *DIGITS, "--ranks", "4")
    node.wait_for('"event": "slots_ready"')
    slot = _spawned(node)
    # A value reported every step: the first one shows the ranks joined and train. A one-card
    # trial trains beside them, on a card of its own, and goes on after their fault.
    long_run = {**SPEC, "budget": {"max_steps": 100_000, "eval_every": 1}}
    beside = studies.create(_batches(16), **long_run, n_trials=1)
    name = studies.create(_batches(64), **long_run, n_trials=1)
    for study in (beside, name):
        studies.wait_until(study, lambda ts: bool(ts) and bool(ts[0].intermediate), SLOW_S)
    ranks = _ranks(node, slot)
    assert len(ranks) == 2, node.logs()[-4000:]
    os.kill(ranks[-1], signal.SIGKILL)
    [trial] = studies.wait_until(name, finished(1), timeout=SLOW_S)
    assert trial.state == "FAIL"
    assert "died (killed by SIGKILL)" in trial.user_attrs["vramtune.fail_reason"]
    assert trial.attempt == 0
    deadline = time.monotonic() + 30
    while _ranks(node, slot) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ranks(node, slot) == []
    assert node.process.poll() is None  # the worker lives on
    [going_on] = studies.trials(beside)
    assert going_on.state == "RUNNING"  # the fault ended the 2-rank trial only
    reported = len(going_on.intermediate)
    studies.wait_until(beside, lambda ts: len(ts[0].intermediate) > reported, SLOW_S)
