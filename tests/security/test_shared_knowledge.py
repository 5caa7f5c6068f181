"""Issue 30, items 1-3 and 11: a trust boundary for what workers teach the fleet, and fair
dispatch. Each attack of the issue, against a real server (uvicorn subprocess, auth on) on
SQLite and PostgreSQL, on a database that `vramtune db upgrade` created.

Who may teach what is docs/concepts/security.md, "Security model": a study-limited token's
predictions and observations count for its own studies only; the server keys a prediction by
the shape of the trial it was made for; a run measured far beyond a shared prediction withdraws
it; a worker holds at most its slots' leases (and one ahead); routing believes a card's size up
to VRAMTUNE_MAX_CARD_BYTES unless its worker has measured that much.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from security_fixtures import first_token

from vramtune.common.step_time import default_step_time_fit, predicted_step_s
from vramtune.service.testing import (
    fresh_postgres_database,
    run_vramtune,
    server_factory,
    sqlite_url,
)
from vramtune.service.wire import StepTimeFit, StepTimeObservation

GIB = 2**30
MIB = 2**20
_names = itertools.count()
PLAN = {"micro_batch": None, "accumulation": 1, "checkpointing": False, "bf16": False}
SHAPE = {"width": 64}  # every study here has it: their trials are one shape
HONEST_CARD = 8 * GIB
HOARDER_CARD = 10**18


def prediction(peak: int) -> dict[str, Any]:
    """A traced prediction of ``peak`` bytes."""
    return {"peak_allocated_bytes": peak, "peak_reserved_bytes": peak, "method": "trace"}


def measured(peak: int) -> dict[str, int]:
    """A run's measured peaks."""
    return {"peak_allocated_bytes": peak, "peak_reserved_bytes": peak}


@dataclass
class Server:
    """The module's server, its database and the first admin token."""

    url: str
    admin: str
    database_url: str

    def http(self, token: str | None = None) -> httpx.Client:
        """A client of /api/v1 with a bearer token (the admin's unless given)."""
        headers = {"Authorization": f"Bearer {token or self.admin}"}
        return httpx.Client(base_url=f"{self.url}/api/v1", headers=headers, timeout=30)

    def token(self, *scopes: str, studies: list[str] | None = None) -> str:
        """A new token's clear value, issued over REST."""
        body = {"name": f"t{next(_names)}", "scopes": list(scopes), "studies": studies}
        with self.http() as admin:
            response = admin.post("/tokens", json=body)
        assert response.status_code == 201, response.text
        return str(response.json()["token"])

    def study(self, task: str, n_trials: int = 3, **extra: Any) -> str:
        """A new random-sampler study of ``task`` with one configuration of shape SHAPE."""
        name = f"s{next(_names)}"
        spec = {
            "name": name,
            "task": task,
            "search_space": {"x": {"type": "categorical", "choices": [0.5]}},
            "task_config": SHAPE,
            "sampler": {"name": "random"},
            "pruner": {"name": "none"},
            "n_trials": n_trials,
            **extra,
        }
        with self.http() as admin:
            response = admin.post("/studies", json=spec)
        assert response.status_code == 201, response.text
        return name

    def outcomes(self, study: str) -> Counter[str]:
        """How many of the study's trials ended with each vramtune outcome."""
        with self.http() as admin:
            trials = admin.get(f"/studies/{study}/trials").json()["trials"]
        return Counter(str(t.get("outcome")) for t in trials)


class Worker:
    """A worker speaking the protocol over HTTP with one token, keyed by SHAPE's width."""

    def __init__(
        self,
        server: Server,
        token: str,
        task: str,
        card: int = HONEST_CARD,
        also: str = "",
        **registration: Any,
    ) -> None:
        self.http = server.http(token)
        self.card = card
        tasks = [task, also] if also else [task]
        info = {"model": "H100", "total_bytes": card, "free_bytes": card, "torch_version": "2.13"}
        body = {
            "name": f"w{next(_names)}",
            "device": "cpu",
            "card": info,
            "tasks": tasks,
            "shape_params": {name: ["width"] for name in tasks},
            **registration,
        }
        response = self.http.post("/workers", json=body)
        assert response.status_code == 201, response.text
        self.id = int(response.json()["worker_id"])

    def next(self, free_bytes: int | None = None) -> httpx.Response:
        """POST next as this worker, stating its whole card free unless told."""
        body = {"free_bytes": self.card if free_bytes is None else free_bytes}
        return self.http.post(f"/workers/{self.id}/next", json=body)

    def lease(self) -> dict[str, Any]:
        """An assignment (the next call must give one)."""
        response = self.next()
        assert response.status_code == 200, response.text
        return dict(response.json())

    def call(self, assignment: dict[str, Any], verb: str, **body: Any) -> dict[str, Any]:
        """start, complete or handback of an assignment; it must succeed."""
        url = f"/trials/{assignment['trial_id']}/{verb}"
        response = self.http.post(url, json={"lease": assignment["lease"], **body})
        assert response.status_code == 200, (verb, response.text)
        return dict(response.json())

    def run(self, assignment: dict[str, Any], predicted: int, peak: int, **extra: Any) -> None:
        """Start the trial as asked predicting ``predicted`` bytes, complete it measuring
        ``peak``."""
        self.call(assignment, "start", plan=PLAN, prediction=prediction(predicted))
        done = self.call(
            assignment,
            "complete",
            values=[0.5],
            plan=PLAN,
            prediction=prediction(predicted),
            measured=measured(peak),
            duration_s=1.0,
            **extra,
        )
        assert done["resolution"] == "complete", done


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A real server with auth on, on a freshly upgraded database."""
    directory = tmp_path_factory.mktemp(f"shared-knowledge-{request.param}")
    with fresh_postgres_database() if request.param == "postgresql" else _sqlite(directory) as url:
        upgraded = run_vramtune(
            "db", "upgrade", "--database-url", url, env={"VRAMTUNE_ADMIN_TOKEN": ""}
        )
        assert upgraded.returncode == 0, upgraded.stderr
        admin = first_token(upgraded.stdout)
        assert admin is not None, upgraded.stdout
        with server_factory(directory) as start:
            process = start(url, auth="on", lease_ttl_s=120, worker_stale_s=120)
            yield Server(process.url, admin, url)


class _sqlite:
    def __init__(self, directory: Path) -> None:
        self.url = sqlite_url(directory)

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *_: object) -> None:
        return None


def _task() -> str:
    return f"task{next(_names)}"


def _shared(assignment: dict[str, Any]) -> list[int]:
    """The peaks of the predictions an assignment carries."""
    return [p["prediction"]["peak_reserved_bytes"] for p in assignment["predictions"]]


# ---------------------------------------------------------------- 1. shared predictions


def test_a_study_limited_tokens_predictions_count_for_its_own_study_only(server: Server) -> None:
    """Attack 1: token A, limited to study A, starts its trial with a 10^15-byte prediction of
    the shape study B runs too. B's worker is not given it; A's next trial is (its own study's
    knowledge stays shared within it)."""
    task = _task()
    study_a, study_b = server.study(task), server.study(task)
    attacker = Worker(server, server.token("worker", studies=[study_a]), task)
    victim = Worker(server, server.token("worker", studies=[study_b]), task)
    poisoned = {"shape": SHAPE, "plan": PLAN, "prediction": prediction(10**15)}
    first = attacker.lease()
    attacker.call(first, "start", plan=PLAN, prediction=prediction(10**15), predictions=[poisoned])
    assert _shared(victim.lease()) == [], "study B was given study A's prediction"
    assert _shared(attacker.lease()) == [10**15], "study A's own knowledge is shared within it"


def test_the_server_keys_a_prediction_by_its_trials_own_shape(server: Server) -> None:
    """A fleet token's worker whose trial has width 8 names the shape width 64 in its body:
    the prediction is dropped, and a trial of width 64 is not given it."""
    task = _task()
    narrow = server.study(task, task_config={"width": 8})
    wide = server.study(task)
    fleet = server.token("worker")
    liar, honest = Worker(server, fleet, task), Worker(server, server.token("worker"), task)
    with server.http() as admin:  # the narrow study first: pause the wide one meanwhile
        assert admin.post(f"/studies/{wide}/pause").status_code == 200
    first = liar.lease()
    assert first["study"] == narrow
    lie = {"shape": SHAPE, "plan": PLAN, "prediction": prediction(10**15)}
    liar.call(first, "start", plan=PLAN, prediction=prediction(GIB), predictions=[lie])
    with server.http() as admin:
        assert admin.post(f"/studies/{narrow}/pause").status_code == 200
        assert admin.post(f"/studies/{wide}/resume").status_code == 200
    given = honest.lease()
    assert given["study"] == wide and _shared(given) == [], "a shape the trial does not have"


def test_a_shared_prediction_a_run_measures_far_beyond_is_withdrawn(server: Server) -> None:
    """A fleet worker shares a tiny prediction of its own shape; the next worker of the shape
    is given it, runs, and measures 1 GiB: the prediction is withdrawn, the third is not
    given it (it would run as asked and die out of memory)."""
    task = _task()
    study = server.study(task, n_trials=3)
    maker, runner, third = (Worker(server, server.token("worker"), task) for _ in range(3))
    first = maker.lease()
    tiny = {"shape": SHAPE, "plan": PLAN, "prediction": prediction(MIB)}
    maker.call(first, "start", plan=PLAN, prediction=prediction(MIB), predictions=[tiny])
    second = runner.lease()
    assert _shared(second) == [MIB], "honest sharing: the fleet's prediction comes with it"
    runner.run(second, predicted=MIB, peak=GIB)
    assert _shared(third.lease()) == [], "the contradicted prediction was withdrawn"
    assert server.outcomes(study)["as_asked"] == 1


# ---------------------------------------------------------------- 2. calibration, step time


def test_a_study_limited_tokens_completes_do_not_move_the_fleets_calibration(
    server: Server,
) -> None:
    """Attack 2: fourteen fabricated completes (measured 4x the prediction, step times of an
    hour) from a token limited to study A leave the calibration and step-time model served to
    every other H100 worker of the task at their defaults; study A's own token sees its own."""
    task = _task()
    study_a = server.study(task, n_trials=14)
    own = server.token("worker", studies=[study_a])
    attacker = Worker(server, own, task)
    step = {"batch_size": 64, "micro_batch": 64, "micro_batches": 1, "measured_step_s": 3600.0}
    for _ in range(14):
        attacker.run(attacker.lease(), predicted=100 * MIB, peak=400 * MIB, step_time=step)
    query = {"card_model": "H100", "torch_version": "2.13", "task": task}
    fleet = Worker(server, server.token("worker"), task)
    served = fleet.http.get("/calibration", params=query).json()
    assert (served["scale"], served["margin_fraction"]) == (1.0, 0.05), served
    assert served["offset_bytes"] == 0 and served["n_observations"] == 0
    timing = fleet.http.get("/step-time", params={"card_model": "H100", "task": task}).json()
    assert timing["n_observations"] == 0, timing
    mine = attacker.http.get("/calibration", params={**query, "study": study_a}).json()
    assert mine["n_observations"] == 14 and mine["scale"] > 3.9, "its own study learns from it"


def _step(seconds: float) -> dict[str, Any]:
    """A run's step-time report: the study as asked, ``seconds`` a step."""
    return {"batch_size": 64, "micro_batch": 64, "micro_batches": 1, "measured_step_s": seconds}


def _timing(asker: Worker, task: str, worker_id: int) -> httpx.Response:
    """GET step-time for the H100 and ``task`` as ``asker``'s token, naming ``worker_id``."""
    query = {"card_model": "H100", "task": task, "worker_id": worker_id}
    return asker.http.get("/step-time", params=query)


def test_one_fleet_worker_cannot_move_the_step_time_served_to_others(server: Server) -> None:
    """Attack 2, step time, from a token valid for every study (trusted to teach the fleet):
    its one worker completes 10 trials claiming an hour a step. Another worker is served the
    fixed model; so it still is beside one honest worker (no majority, an hour against a
    tenth of a second); two honest workers' 3 runs each teach it their tenth of a second, and
    the hour is dropped. A worker's own id is not another token's to name."""
    task = _task()
    server.study(task, n_trials=16)
    attacker = Worker(server, server.token("worker"), task)
    for _ in range(10):
        attacker.run(attacker.lease(), predicted=GIB, peak=GIB, step_time=_step(3600.0))
    victim = Worker(server, server.token("worker"), task)
    assert _timing(attacker, task, attacker.id).json()["n_observations"] == 10, "its own"
    assert _timing(victim, task, victim.id).json() == _default_timing(task)
    assert _timing(attacker, task, victim.id).status_code == 403
    honest = [Worker(server, server.token("worker"), task) for _ in range(2)]
    for number, seconds in enumerate([0.1, 0.11, 0.09] * 2):
        worker = honest[number // 3]
        worker.run(worker.lease(), predicted=GIB, peak=GIB, step_time=_step(seconds))
        if number == 2:
            assert _timing(victim, task, victim.id).json() == _default_timing(task)
    taught = StepTimeFit.model_validate(_timing(victim, task, victim.id).json())
    assert taught.n_observations == 6, "the hour-long steps were dropped"
    as_asked = StepTimeObservation.model_validate(_step(0.0))
    assert predicted_step_s(taught, as_asked) == pytest.approx(0.1, rel=0.1)


def _default_timing(task: str) -> dict[str, Any]:
    """The fixed model for the H100 and ``task``, as served."""
    return default_step_time_fit("H100", task).model_dump(mode="json")


# ---------------------------------------------------------------- 3. fair dispatch


def test_one_worker_cannot_hoard_a_study(server: Server) -> None:
    """Attack 3: a worker claiming a 10^18-byte card asks 31 times for a 30-trial study: it
    gets its one slot's lease and one ahead, then nothing; an honest worker gets the rest."""
    task = _task()
    server.study(task, n_trials=30)
    hoarder = Worker(server, server.token("worker"), task, card=HOARDER_CARD)
    answers = Counter(hoarder.next().status_code for _ in range(31))
    assert answers == Counter({200: 2, 204: 29}), answers
    honest = Worker(server, server.token("worker"), task)
    assert honest.next().status_code == 200


def test_free_bytes_beyond_the_registered_card_are_refused(server: Server) -> None:
    task = _task()
    worker = Worker(server, server.token("worker"), task)
    refused = worker.next(free_bytes=HONEST_CARD + 1)
    assert refused.status_code == 422 and "free_bytes" in refused.text, refused.text


def test_a_hand_back_does_not_wait_for_a_card_never_seen_to_run(server: Server) -> None:
    """Attack 3, routing: with a 10^18-byte card live that never ran a trial, a trial needing
    64 GiB handed back by an 8 GiB card ends infeasible instead of waiting for it forever."""
    task = _task()
    study = server.study(task, n_trials=1)
    Worker(server, server.token("worker"), task, card=HOARDER_CARD)  # live, leases nothing
    honest = Worker(server, server.token("worker"), task)
    handed = honest.call(honest.lease(), "handback", min_footprint_bytes=64 * GIB)
    assert handed["resolution"] == "infeasible", handed
    assert server.outcomes(study) == Counter({"infeasible": 1})


def test_a_hand_back_waits_for_a_large_card_within_the_bound(server: Server) -> None:
    """Honest routing is unchanged: a 256 GiB card (within the bound) makes it wait."""
    task = _task()
    server.study(task, n_trials=1)
    large = Worker(server, server.token("worker"), task, card=256 * GIB)
    honest = Worker(server, server.token("worker"), task)
    handed = honest.call(honest.lease(), "handback", min_footprint_bytes=64 * GIB)
    assert handed["resolution"] == "waiting", handed
    assert large.lease()["trial_id"] == handed["trial_id"]


# ---------------------------------------------------------------- 11. what a read token sees


def test_a_study_limited_token_sees_only_its_studies_counts_and_fits(server: Server) -> None:
    """Item 11: a worker of tasks A and B completes a trial of study B, then one of study A,
    and holds another of A. A token limited to A lists it with A's completed count (1, not 2);
    it may not read the fits of B's task, or of a card no worker or trial of its own has."""
    task_a, task_b = _task(), _task()
    study_a, study_b = server.study(task_a), server.study(task_b)
    both = Worker(server, server.token("worker"), task_a, also=task_b)
    with server.http() as admin:
        assert admin.post(f"/studies/{study_a}/pause").status_code == 200
        both.run(both.lease(), predicted=GIB, peak=GIB)  # study B's
        assert admin.post(f"/studies/{study_a}/resume").status_code == 200
        assert admin.post(f"/studies/{study_b}/pause").status_code == 200
    both.run(both.lease(), predicted=GIB, peak=GIB)  # study A's
    held = both.lease()
    reader = server.http(server.token("read", studies=[study_a]))
    [listed] = reader.get("/workers").json()["workers"]
    assert (listed["id"], listed["current_trials"]) == (both.id, [held["trial_id"]])
    assert listed["trials_done"] == 1, "study B's trial is not this token's to count"
    fit = {"card_model": "H100", "torch_version": "2.13"}
    other_task = reader.get("/calibration", params={**fit, "task": task_b})
    assert other_task.status_code == 403 and "task" in other_task.json()["detail"]
    timing = reader.get("/step-time", params={"card_model": "H100", "task": task_b})
    assert timing.status_code == 403
    other_card = reader.get("/calibration", params={**fit, "card_model": "B200", "task": task_a})
    assert other_card.status_code == 403 and "card_model" in other_card.json()["detail"]
    assert reader.get("/calibration", params={**fit, "task": task_a}).status_code == 200


# ---------------------------------------------------------------- issue 47


SCOPED_COUNT = sa.text("SELECT count(*) FROM {table} WHERE scope = :bare OR scope LIKE :stamped")
KNOWLEDGE_TABLES = ("vramtune_predictions", "vramtune_memory_observations", "vramtune_step_times")


def _scoped_rows(server: Server, study_id: int) -> int:
    """Rows of shared predictions, memory and step-time observations kept for the study only
    (a scope naming its id, with or without its creation stamp)."""
    keys = {"bare": f"study:{study_id}", "stamped": f"study:{study_id}:%"}
    engine = sa.create_engine(server.database_url)
    try:
        with engine.connect() as connection:
            counts = [
                connection.scalar(sa.text(SCOPED_COUNT.text.format(table=table)), keys)
                for table in KNOWLEDGE_TABLES
            ]
    finally:
        engine.dispose()
    return sum(int(count or 0) for count in counts)


def test_a_deleted_studys_knowledge_goes_with_it(server: Server) -> None:
    """Issue 47, 5: study X's limited token shares a 10^15-byte prediction and completes a
    run; X is deleted. Its own rows go with it, and a new study Y (given X's id again on
    SQLite) is not served the prediction."""
    task = _task()
    study_x = server.study(task, n_trials=2)
    with server.http() as admin:
        x_id = admin.get(f"/studies/{study_x}").json()["id"]
    attacker = Worker(server, server.token("worker", studies=[study_x]), task)
    poisoned = {"shape": SHAPE, "plan": PLAN, "prediction": prediction(10**15)}
    first = attacker.lease()
    attacker.call(first, "start", plan=PLAN, prediction=prediction(10**15), predictions=[poisoned])
    attacker.run(attacker.lease(), predicted=100 * MIB, peak=400 * MIB, step_time=_step(3600.0))
    assert _scoped_rows(server, x_id) >= 3
    with server.http() as admin:
        assert admin.delete(f"/studies/{study_x}").status_code == 204
    assert _scoped_rows(server, x_id) == 0
    study_y = server.study(task)
    newcomer = Worker(server, server.token("worker", studies=[study_y]), task)
    given = newcomer.lease()
    assert given["study"] == study_y and _shared(given) == [], "study X's prediction"
    query = {"card_model": "H100", "torch_version": "2.13", "task": task, "study": study_y}
    assert newcomer.http.get("/calibration", params=query).json()["n_observations"] == 0


def test_a_token_of_two_studies_gets_each_studys_own_calibration(server: Server) -> None:
    """Issue 47, 4: token C (study C only) completes 14 runs at 4x and an hour a step; a
    worker of a token of [A, C] asking for study A's trial is served the defaults, and for
    study C's, C's own fit. Not naming a study gets the fleet's only."""
    task = _task()
    study_a, study_c = server.study(task), server.study(task, n_trials=14)
    with server.http() as admin:
        assert admin.post(f"/studies/{study_a}/pause").status_code == 200
    attacker = Worker(server, server.token("worker", studies=[study_c]), task)
    for _ in range(14):
        attacker.run(attacker.lease(), predicted=100 * MIB, peak=400 * MIB, step_time=_step(3600.0))
    both = Worker(server, server.token("worker", studies=[study_a, study_c]), task)
    fit = {"card_model": "H100", "torch_version": "2.13", "task": task, "worker_id": both.id}
    timing = {"card_model": "H100", "task": task, "worker_id": both.id}
    for named in ({"study": study_a}, {}):
        served = both.http.get("/calibration", params={**fit, **named}).json()
        assert (served["scale"], served["offset_bytes"]) == (1.0, 0), (named, served)
        assert served["n_observations"] == 0, named
        steps = both.http.get("/step-time", params={**timing, **named}).json()
        assert steps["n_observations"] == 0, (named, steps)
    own = both.http.get("/calibration", params={**fit, "study": study_c}).json()
    assert own["n_observations"] == 14, "study C's trials learn from study C's runs"
    other = Worker(server, server.token("worker", studies=[study_a]), task)
    refused = other.http.get(
        "/calibration", params={**fit, "worker_id": other.id, "study": study_c}
    )
    assert refused.status_code == 403 and "study" in refused.json()["detail"], refused.text
    wrong_task = both.http.get("/step-time", params={**timing, "task": "other", "study": study_c})
    assert wrong_task.status_code in (403, 422), wrong_task.text


def test_registered_slots_do_not_lease_a_study_that_does_not_pack(server: Server) -> None:
    """Issue 47, 2: a worker registering 64 slots asks 40 times for a 30-trial study without
    packing: one lease and one ahead, as a one-slot worker; an honest worker gets the rest."""
    task = _task()
    server.study(task, n_trials=30)
    hoarder = Worker(server, server.token("worker"), task, slots=64)
    answers = Counter(hoarder.next().status_code for _ in range(40))
    assert answers == Counter({200: 2, 204: 38}), answers
    honest = Worker(server, server.token("worker"), task)
    assert honest.next().status_code == 200


def test_packing_leases_more_only_as_far_as_measured_runs_fit(server: Server) -> None:
    """A study that allows packing: before any measured run, one lease and one ahead; once a
    run measured 2 GiB on the 8 GiB card, four (the card over the peak, within the 4 slots)
    and one ahead."""
    task = _task()
    server.study(task, n_trials=12, memory_policy={"allow_packing": True})
    packer = Worker(server, server.token("worker"), task, slots=4)
    leased = [packer.lease()]
    assert packer.next().status_code == 200 and packer.next().status_code == 204
    packer.run(leased[0], predicted=2 * GIB, peak=2 * GIB)
    answers = Counter(packer.next().status_code for _ in range(8))
    assert answers == Counter({200: 4, 204: 4}), answers


def test_a_hand_back_does_not_wait_for_a_card_that_cannot_lease_the_study(
    server: Server,
) -> None:
    """Issue 47, 3: token B's 256 GiB card (within the bound, heartbeating) is limited to
    another study: study A's trial handed back as needing 64 GiB ends infeasible at once
    instead of waiting for a card that is never offered it."""
    task = _task()
    study_a, study_b = server.study(task, n_trials=1), server.study(task, n_trials=1)
    with server.http() as admin:
        assert admin.post(f"/studies/{study_b}/pause").status_code == 200
    Worker(server, server.token("worker", studies=[study_b]), task, card=256 * GIB)
    honest = Worker(server, server.token("worker", studies=[study_a]), task)
    handed = honest.call(honest.lease(), "handback", min_footprint_bytes=64 * GIB)
    assert handed["resolution"] == "infeasible", handed
    assert server.outcomes(study_a) == Counter({"infeasible": 1})


def test_advice_names_only_cards_that_may_lease_the_study(server: Server) -> None:
    """Issue 47, 7: with no live worker, advice's "largest card" was the largest any token
    ever registered: another team's stopped worker (256 GiB here, within routing's bound; a
    10^18-byte one read "-909494 TiB short"). It is the largest card that may lease the
    study, as routing believes it."""
    task = _task()
    study_a, study_b = server.study(task, n_trials=1), server.study(task, n_trials=1)
    with server.http() as admin:
        assert admin.post(f"/studies/{study_b}/pause").status_code == 200
    for card in (256 * GIB, HOARDER_CARD):
        other = Worker(server, server.token("worker", studies=[study_b]), task, card=card)
        assert other.http.post(f"/workers/{other.id}/stop").status_code == 204
    own = Worker(server, server.token("worker", studies=[study_a]), task)
    handed = own.call(own.lease(), "handback", min_footprint_bytes=64 * GIB)
    assert handed["resolution"] == "infeasible", handed
    assert own.http.post(f"/workers/{own.id}/stop").status_code == 204
    with server.http() as admin:
        advice = admin.get(f"/dashboard/studies/{study_a}/advice").json()
    [item] = [item for item in advice["items"] if item["kind"] == "infeasible"]
    assert item["largest_card_bytes"] == HONEST_CARD, item
    assert "256" not in item["text"] and "TiB" not in item["text"], item["text"]


def test_a_start_on_several_cards_needs_a_distributed_study(server: Server) -> None:
    """Issue 47, 8: a two-rank DDP plan on a study without `distributed` was stored as run."""
    task = _task()
    server.study(task, n_trials=1)
    worker = Worker(server, server.token("worker"), task)
    assignment = worker.lease()
    ddp = {**PLAN, "world_size": 2, "strategy": "ddp"}
    url = f"/trials/{assignment['trial_id']}/start"
    refused = worker.http.post(url, json={"lease": assignment["lease"], "plan": ddp})
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"][0]["loc"] == ["body", "plan", "world_size"]
    worker.run(assignment, predicted=GIB, peak=GIB)  # the lease still runs as asked
