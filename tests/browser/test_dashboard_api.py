"""The dashboard's JSON endpoints on SQLite and PostgreSQL, on trials run through the protocol."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from vramtune.service.settings import Settings
from vramtune.service.testing import (
    IN_PROCESS_HOSTS,
    fresh_postgres_database,
    sqlite_url,
    upgrade_database,
)

V = "/api/v1"
D = f"{V}/dashboard/studies"
STUDY = "api-study"
N_TRIALS = 12
MIB = 1024 * 1024
CARD = 512 * MIB


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def client(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient]:
    """create_app on a migrated database, one study whose trials one worker ran, in four ways."""
    from vramtune.service.app import create_app

    with ExitStack() as stack:
        if request.param == "sqlite":
            url = sqlite_url(tmp_path_factory.mktemp("dashboard-api"))
        else:
            url = stack.enter_context(fresh_postgres_database())
        upgrade_database(url)
        app = create_app(Settings(database_url=url, auth="off", allowed_hosts=IN_PROCESS_HOSTS))
        client = stack.enter_context(TestClient(app))
        run_study(client)
        yield client


def run_study(client: TestClient) -> None:
    """Every trial: as asked, resized, OOM then retried, or handed back (infeasible)."""
    spec = {
        "name": STUDY,
        "task": "quadratic",
        "search_space": {
            "x": {"type": "float", "low": -1.0, "high": 1.0},
            "width": {"type": "categorical", "choices": [64, 256]},
        },
        "sampler": {"name": "random", "args": {"seed": 5}},
        "pruner": {"name": "none"},
        "n_trials": N_TRIALS,
    }
    assert client.post(f"{V}/studies", json=spec).status_code == 201
    card = {"model": "sim-512MiB", "total_bytes": CARD, "free_bytes": CARD, "simulated": True}
    worker = {"name": "api-worker", "device": "cpu", "card": card, "tasks": ["quadratic"]}
    worker_id = ok(client.post(f"{V}/workers", json=worker))["worker_id"]
    for _ in range(4 * N_TRIALS):
        response = client.post(f"{V}/workers/{worker_id}/next", json={"free_bytes": CARD})
        if response.status_code == 204:
            return
        run_trial(client, ok(response))
    pytest.fail("the study never ran out of trials")


def run_trial(client: TestClient, job: dict[str, Any]) -> None:
    """Start, report and end one assignment according to its trial number."""
    trial, lease, number = job["trial_id"], job["lease"], job["number"]
    peak = (40 + 10 * number) * MIB
    prediction = {"peak_allocated_bytes": peak, "peak_reserved_bytes": peak}
    plan: dict[str, Any] = {"micro_batch": 8, "accumulation": 4} if number % 4 == 1 else {}
    if number == 9:  # every rung that keeps the numerics
        plan |= {"checkpointing": True, "checkpoint_blocks": 2, "chunked_loss": True}
    if number % 4 == 3:
        handback = {"lease": lease, "min_footprint_bytes": 2 * CARD, "reason": "too big"}
        ok(client.post(f"{V}/trials/{trial}/handback", json=handback))
        return
    ok(
        client.post(
            f"{V}/trials/{trial}/start",
            json={"lease": lease, "plan": plan, "prediction": prediction},
        )
    )
    for step in (1, 2, 3):
        report = {"lease": lease, "step": step, "value": 1.0 / step + number}
        ok(client.post(f"{V}/trials/{trial}/report", json=report))
    measured = {"peak_allocated_bytes": int(peak * 1.05)}
    if number % 4 == 2 and job["attempt"] == 0:
        oom = {"lease": lease, "kind": "oom", "plan": plan, "measured": measured, "message": "OOM"}
        ok(client.post(f"{V}/trials/{trial}/fail", json=oom))
        return
    done = {"lease": lease, "values": [float(number)], "plan": plan, "prediction": prediction}
    done |= {"measured": measured, "duration_s": 1.0 + number}
    ok(client.post(f"{V}/trials/{trial}/complete", json=done))


def ok(response: Any) -> Any:
    """The JSON of a 2xx answer (the body in the failure message otherwise)."""
    assert response.status_code < 300, response.text
    return response.json() if response.content else None


def get(client: TestClient, path: str, **params: Any) -> Any:
    return ok(client.get(path, params=params))


def test_studies_list_counts_and_best_feasible_value(client: TestClient) -> None:
    (study,) = [s for s in get(client, D)["studies"] if s["name"] == STUDY]
    assert study["finished"] == N_TRIALS
    assert study["state"] == "done"
    assert sum(study["counts"].values()) == N_TRIALS
    # numbers 3, 7, 11 were handed back (infeasible): their placeholder values never count
    assert study["best_value"] == 0.0
    # 1, 5, 9 resized; 2, 6, 10 ran out of memory once (then ran again); one card: none routed
    assert study["memory"] == {
        "resized": 3,
        "routed": 0,
        "routed_pruned": 0,
        "infeasible": 3,
        "oom": 3,
    }


def test_metric_names_name_the_objectives(client: TestClient) -> None:
    space = {"x": {"type": "float", "low": 0.0, "high": 1.0}}
    spec = {"task": "quadratic", "search_space": space, "metric_names": ["val_loss"]}
    assert client.post(f"{V}/studies", json=spec | {"name": "api-named"}).status_code == 201
    assert get(client, f"{D}/api-named")["objective_names"] == ["val_loss"]
    with_peak = spec | {"name": "api-named-peak", "minimize_peak_memory": True}
    assert client.post(f"{V}/studies", json=with_peak).status_code == 201
    names = get(client, f"{D}/api-named-peak")["objective_names"]
    assert names == ["val_loss", "peak memory (bytes)"]
    for name in ("api-named", "api-named-peak"):  # no worker is to run them
        ok(client.post(f"{V}/studies/{name}/pause"))
    two = spec | {"name": "api-named-bad", "metric_names": ["a", "b"]}
    refused = client.post(f"{V}/studies", json=two)
    assert refused.status_code == 422
    assert refused.json()["detail"][0]["loc"] == ["body", "metric_names"]


def test_a_plain_optuna_study_has_no_memory_counts(client: TestClient) -> None:
    import optuna

    url = client.app.state.vt.settings.database_url  # type: ignore[attr-defined]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(storage=url, study_name="plain-no-memory").optimize(
        lambda t: t.suggest_float("x", 0, 1), n_trials=1
    )
    (plain,) = [s for s in get(client, D)["studies"] if s["name"] == "plain-no-memory"]
    assert plain["memory"] is None


def test_overview_history_and_memory_exclude_infeasible_trials(client: TestClient) -> None:
    overview = get(client, f"{D}/{STUDY}")
    assert overview["infeasible"] == 3
    assert [p["name"] for p in overview["params"]] == ["x", "width"]
    assert overview["card_models"] == ["sim-512MiB"]
    history = get(client, f"{D}/{STUDY}/history")
    feasible = [n for n in range(N_TRIALS) if n % 4 != 3]
    assert history["numbers"] == feasible
    assert history["best_values"] == [0.0, 0.0]  # trial 0 is best from the start
    memory = get(client, f"{D}/{STUDY}/memory")
    assert sorted(memory["numbers"]) == feasible
    assert memory["front_numbers"] == [0]  # lowest peak and lowest value


def test_calibration_counts_every_run_per_card(client: TestClient) -> None:
    (card,) = get(client, f"{D}/{STUDY}/calibration")["cards"]
    assert card["card_model"] == "sim-512MiB"
    assert card["n"] >= 9  # every started run, the OOM attempts included
    assert card["under_fraction"] == 1.0  # every run measured 5 % above its prediction
    assert card["median_abs_error"] == pytest.approx(0.05, abs=0.001)
    assert card["median_bias"] == pytest.approx(0.05, abs=0.001)  # signed: above, not below
    assert get(client, f"{D}/{STUDY}/calibration")["target_under_fraction"] == 0.01


def test_regions_name_each_memory_outcome(client: TestClient) -> None:
    regions = get(client, f"{D}/{STUDY}/regions", x="x", y="width")
    names = {c["name"]: c["count"] for c in regions["categories"]}
    # 2, 6, 10 ran out of memory once, then completed: their prediction missed, so "oom"
    # resized trials are named by the rungs they used (1 and 5: micro-batches, 9: all of them)
    every = "micro-batches + selective checkpointing + chunked cross-entropy"
    assert names == {
        "infeasible": 3,
        "oom": 3,
        "resized: micro-batches": 2,
        f"resized: {every}": 1,
        "as asked": 3,
    }
    assert regions["total"] == N_TRIALS
    assert not any(p for c in regions["categories"] for p in c["pruned"])  # none was pruned


def test_a_pruned_trial_keeps_the_colour_of_how_it_ran(client: TestClient) -> None:
    """Pruned is a mark on a point, not a category: a resized run that was pruned is resized."""
    spec = {
        "name": "api-pruned",
        "task": "quadratic",
        "search_space": {"x": {"type": "float", "low": -1.0, "high": 1.0}},
        "n_trials": 1,
    }
    assert client.post(f"{V}/studies", json=spec).status_code == 201
    (worker,) = [w for w in get(client, f"{V}/workers")["workers"] if w["name"] == "api-worker"]
    job = ok(client.post(f"{V}/workers/{worker['id']}/next", json={"free_bytes": CARD}))
    assert job["study"] == "api-pruned"  # the only vramtune study with trials left
    lease, trial = job["lease"], job["trial_id"]
    plan = {"micro_batch": 4, "accumulation": 2}
    ok(client.post(f"{V}/trials/{trial}/start", json={"lease": lease, "plan": plan}))
    pruned = {"lease": lease, "kind": "pruned", "plan": plan}
    ok(client.post(f"{V}/trials/{trial}/fail", json=pruned))
    (category,) = get(client, f"{D}/api-pruned/regions", x="x", y="x")["categories"]
    assert (category["name"], category["pruned"]) == ("resized: micro-batches", [True])


def test_trial_table_sorts_filters_and_pages(client: TestClient) -> None:
    page = get(client, f"{D}/{STUDY}/trials", sort="duration", order="desc", limit=5)
    durations = [r["duration_s"] for r in page["rows"]]
    assert page["total"] == N_TRIALS and len(durations) == 5
    assert durations == sorted(durations, reverse=True)
    by_width = get(client, f"{D}/{STUDY}/trials", sort="param:width", limit=N_TRIALS)["rows"]
    widths = [r["params"]["width"] for r in by_width]
    assert widths == sorted(widths)
    resized = get(client, f"{D}/{STUDY}/trials", outcome="resized", limit=50)
    assert resized["total"] == 3 and all(r["plan"]["micro_batch"] == 8 for r in resized["rows"])
    words = {r["number"]: r["plan_words"] for r in resized["rows"]}
    assert words[1] == "micro-batch 8 × 4"
    assert words[9] == "micro-batch 8 × 4, checkpoint the first 2 blocks, chunked cross-entropy"
    second = get(client, f"{D}/{STUDY}/trials", sort="number", offset=10, limit=5)
    assert [r["number"] for r in second["rows"]] == [10, 11]
    infeasible = [r for r in by_width if r["outcome"] == "infeasible"]
    assert len(infeasible) == 3 and not any(r["feasible"] for r in infeasible)
    assert get(client, f"{D}/{STUDY}/trials", worker="nobody")["total"] == 0


def test_one_trial_has_its_curve_and_runs(client: TestClient) -> None:
    trial = get(client, f"{D}/{STUDY}/trials/2")
    assert trial["intermediate_steps"] == [1, 2, 3]
    assert trial["observations"][0]["outcome"] == "oom"
    assert trial["attempt"] == 1


def test_importances_use_optunas_evaluator(client: TestClient) -> None:
    found = get(client, f"{D}/{STUDY}/importances")
    assert found["evaluator"] == "PedAnovaImportanceEvaluator"
    assert found["n_used"] == N_TRIALS - 3
    assert {i["name"] for i in found["importances"]} <= {"x", "width"}
    assert found["caveat"].startswith("from 9 completed trials only")  # fewer than 10


def two_objectives(trial: Any) -> tuple[float, float]:
    """Objective 0 (minimized) follows a, a little b; objective 1 (maximized) follows c."""
    a, b, c = (trial.suggest_float(name, 0, 1) for name in "abc")
    return a + 0.1 * b, c


def test_two_objectives_have_a_front_and_importances_of_their_own(client: TestClient) -> None:
    import optuna

    url = client.app.state.vt.settings.database_url  # type: ignore[attr-defined]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        storage=url,
        study_name="two-objectives",
        directions=["minimize", "maximize"],
        sampler=optuna.samplers.RandomSampler(seed=1),
    )
    study.optimize(two_objectives, n_trials=40)
    path = f"{D}/two-objectives"
    pareto = get(client, f"{path}/pareto", x=0, y=1)
    assert sorted(pareto["front_numbers"]) == sorted(t.number for t in study.best_trials)
    assert pareto["front_x"] == sorted(pareto["front_x"])
    assert pareto["total"] == 40 and pareto["y_direction"] == "maximize"
    swapped = get(client, f"{path}/pareto", x=1, y=0)
    assert sorted(swapped["front_numbers"]) == sorted(pareto["front_numbers"])
    for objective, driver in ((0, "a"), (1, "c")):  # Optuna's target= picks the objective
        answer = get(client, f"{path}/importances", objective=objective)
        found = answer["importances"]
        assert max(found, key=lambda i: i["importance"])["name"] == driver
        assert answer["caveat"] is None  # 40 completed trials
    history = get(client, f"{path}/history", objective=1)
    assert history["direction"] == "maximize"
    assert history["best_values"][-1] == max(t.values[1] for t in study.trials)
    rows = get(client, f"{path}/trials", sort="value:1", order="desc", limit=3)["rows"]
    highest = sorted((t.values[1] for t in study.trials), reverse=True)[:3]
    assert [r["values"][1] for r in rows] == highest
    assert client.get(f"{path}/pareto", params={"x": 0, "y": 0}).status_code == 422


def test_fleet_lists_the_worker_and_its_card(client: TestClient) -> None:
    (worker,) = get(client, f"{V}/dashboard/fleet")["workers"]
    assert worker["name"] == "api-worker"
    assert worker["total_bytes"] == CARD
    # 12 trials: 9 completed; 2, 6 and 10 ran twice (an OOM, then a retry); 3, 7, 11 handed back
    assert worker["trials_done"] == 9
    pruned_run = any(s["name"] == "api-pruned" for s in get(client, D)["studies"])
    assert worker["trials_run"] == 12 + pruned_run


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        (f"{D}/{STUDY}/trials", {"sort": "nonsense"}, "sort"),
        (f"{D}/{STUDY}/trials", {"limit": 0}, "limit"),
        (f"{D}/{STUDY}/regions", {"x": "x", "y": "missing"}, "y"),
        (f"{D}/{STUDY}/history", {"objective": 1}, "objective"),
        (f"{D}/{STUDY}/pareto", {"x": 0, "y": 1}, "y"),  # one objective: no front of two
        (f"{D}/{STUDY}/trials", {"sort": "value:x"}, "sort"),
        (f"{D}/{STUDY}/history", {"max_points": 1}, "max_points"),
        (f"{D}/{STUDY}/trials", {"worker": "a\x00b"}, "worker"),  # PostgreSQL text holds no NUL
        (f"{D}/{STUDY}/regions", {"x": "\x00"}, "x"),
    ],
)
def test_bad_queries_get_a_422_naming_the_field(
    client: TestClient, path: str, params: dict[str, Any], field: str
) -> None:
    response = client.get(path, params=params)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["query", field]


def test_an_unknown_study_is_a_404_and_a_nul_in_its_name_a_422(client: TestClient) -> None:
    for suffix in ("", "/history", "/trials", "/trials/0"):
        assert client.get(f"{D}/no-such-study{suffix}").status_code == 404
        assert client.get(f"{D}/bad%00name{suffix}").status_code == 422


def test_pages_and_assets_are_served_with_their_types(client: TestClient, tmp_path: Path) -> None:
    for path in ("/", f"/studies/{STUDY}", "/fleet"):
        response = client.get(path)
        assert response.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in response.headers["content-security-policy"]
    plot = client.get("/dashboard/static/plot.js")
    assert plot.headers["content-type"].startswith("text/javascript")
    cached = client.get(
        "/dashboard/static/common.js", headers={"If-None-Match": plot.headers["etag"]}
    )
    assert cached.status_code == 200  # another file's ETag
    etag = cached.headers["etag"]
    assert (
        client.get("/dashboard/static/common.js", headers={"If-None-Match": etag}).status_code
        == 304
    )
    assert client.get("/dashboard/static/shell.html").status_code == 404
    assert client.get("/dashboard/static/..%2Fpages.py").status_code == 404


def test_answers_follow_the_study_when_it_changes(client: TestClient) -> None:
    import optuna

    url = client.app.state.vt.settings.database_url  # type: ignore[attr-defined]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=url, study_name="cache-check")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    first = get(client, f"{D}/cache-check/history")
    assert len(first["numbers"]) == 1
    assert get(client, f"{D}/cache-check/history") == first  # unchanged: the same answer
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    assert len(get(client, f"{D}/cache-check/history")["numbers"]) == 2
    assert get(client, f"{D}/cache-check/trials")["total"] == 2
    assert get(client, f"{D}/cache-check")["finished"] == 2


def test_fleet_marks_quiet_workers_stale_then_lost(client: TestClient) -> None:
    from datetime import UTC, datetime, timedelta

    from vramtune.service.db.tables import WorkerRow

    now = datetime.now(UTC).replace(tzinfo=None)
    quiet = {"quiet-20s": timedelta(seconds=20), "quiet-1h": timedelta(hours=1)}
    with client.app.state.vt.sessions.begin() as session:  # type: ignore[attr-defined]
        for name, silence in quiet.items():
            card = {"model": "sim", "total_bytes": CARD, "free_bytes": CARD}
            session.add(
                WorkerRow(
                    name=name, device="cpu", card_model="sim", total_bytes=CARD, free_bytes=CARD,
                    card=card, constants={}, tasks=["quadratic"], registered_at=now - silence,
                    last_heartbeat=now - silence, stopped=False, trials_done=0,
                )
            )  # fmt: skip
    fleet = get(client, f"{V}/dashboard/fleet")
    states = {w["name"]: w["state"] for w in fleet["workers"]}
    # defaults: heartbeats every 5 s, stale after 12.5 s without one, lost after 30 s
    assert states["quiet-20s"] == "stale"
    assert states["quiet-1h"] == "lost"
    assert fleet["totals"]["workers"]["lost"] >= 1
    live = [w for w in fleet["workers"] if w["state"] == "live"]
    assert fleet["totals"]["total_bytes"] == sum(w["total_bytes"] for w in live)
