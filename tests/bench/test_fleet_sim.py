"""bench/fleet_sim.py at a tiny scale: eight workers on SQLite, churning, every trial once."""

from __future__ import annotations

import pytest

from bench import fleet_sim

pytestmark = pytest.mark.timeout(120)  # a server subprocess and a ~20 s simulated fleet


def test_a_tiny_churning_fleet_finishes_every_trial_exactly_once() -> None:
    options = fleet_sim.Options(
        cards=8,
        time_factor=30,
        lease_ttl_s=60,  # 2 s real: well above the heartbeat's batch window of 0.5 s
        trial_minutes=1,
        warmup_min=1,
        window_min=3,
        leave_per_hour=10,
        death_per_hour=10,
        database="sqlite",
    )
    result = fleet_sim.run(options)
    accounting = result["accounting"]
    assert (accounting["lost"], accounting["duplicated"], accounting["stuck"]) == (0, 0, 0)
    assert accounting["trials"] == accounting["budget"] > 0
    assert accounting["active_leases"] == 0
    assert set(accounting["optuna_states"]) <= {"COMPLETE", "FAIL"}, accounting
    assert accounting["outcomes"].get("routed", 0) > 0  # a 24 GiB card handed a trial back
    churn = result["churn"]
    assert churn.get("deaths", 0) > 0 and churn.get("leaves", 0) > 0 and churn["joins"] > 0
    assert accounting["leases_ended_by"].get("reaper", 0) > 0  # the dead workers' leases
    assert result["card_hours"] > 0 and result["cpu_s_per_card_hour"]["server"] > 0
    assert "POST /api/v1/workers/{id}/heartbeat" in result["by_call"]
    for call in ("register", "heartbeat", "next", "start", "complete", "handback"):
        assert result["latency"][call]["n"] > 0, call


def test_the_mix_counts_cards_and_nodes() -> None:
    kinds = fleet_sim.parse_mix("24GiB:0.6,80GiB:0.3,8x80GiB:0.1")
    sizes = [(kind.cards, kind.card_bytes // 2**30) for kind in kinds]
    assert sizes == [(1, 24), (1, 80), (8, 80)]
    assert len(fleet_sim.fleet_of(1000, kinds)) == 600 + 300 + 12  # a node counts 8 cards
    with pytest.raises(ValueError, match="sum to"):
        fleet_sim.parse_mix("24GiB:0.6")
