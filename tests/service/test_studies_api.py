"""The study API on SQLite and PostgreSQL, over a real uvicorn server and in process."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import optuna
import pytest
from fastapi.testclient import TestClient
from optuna.distributions import (
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    json_to_distribution,
)
from optuna.storages import RDBStorage
from optuna.trial import TrialState
from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.orm import Session

from vramtune.service.app import create_app
from vramtune.service.db.tables import LeaseRow, StudyRow, TrialRow, WorkerRow
from vramtune.service.optuna.glue import SEARCH_SPACE_ATTR, TASK_ATTR
from vramtune.service.settings import Settings
from vramtune.service.testing import (
    IN_PROCESS_HOSTS,
    fresh_postgres_database,
    server_factory,
    sqlite_url,
    upgrade_database,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)

# ---------------------------------------------------------------- fixtures: one database per
# backend and module, one server and one in-process client on it; studies get unique names.


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated database shared by this module's tests on one backend."""
    if request.param == "sqlite":
        yield upgrade_database(sqlite_url(tmp_path_factory.mktemp("db")))
        return
    with fresh_postgres_database() as pg_url:
        yield upgrade_database(pg_url)


@pytest.fixture(scope="module")
def engine(url: str) -> Iterator[Engine]:
    """A plain engine to look at the tables behind the API's back."""
    engine = create_engine(url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def plain(url: str) -> Iterator[RDBStorage]:
    """Plain Optuna storage on the module's database: a client no one here wrote."""
    storage = RDBStorage(url)
    yield storage
    storage.engine.dispose()


@pytest.fixture(scope="module")
def http_server(url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `vramtune serve` on the module's database."""
    with server_factory(tmp_path_factory.mktemp("logs")) as start:
        yield start(url).url


@pytest.fixture(scope="module")
def in_process(url: str) -> Iterator[TestClient]:
    """create_app in process on the module's database; paths are relative to /api/v1/."""
    app = create_app(Settings(database_url=url, auth="off", allowed_hosts=IN_PROCESS_HOSTS))
    with TestClient(app, base_url="http://testserver/api/v1/") as client:
        yield client


@pytest.fixture(params=["http", "in_process"])
def api(request: pytest.FixtureRequest, url: str) -> Iterator[httpx.Client]:
    """An HTTP client of /api/v1, over the network or in process (url: on every backend)."""
    if request.param == "in_process":
        yield request.getfixturevalue("in_process")
        return
    with httpx.Client(base_url=request.getfixturevalue("http_server") + "/api/v1/") as client:
        yield client


def spec(**overrides: Any) -> dict[str, Any]:
    """A valid study spec with a unique name."""
    body: dict[str, Any] = {
        "name": f"s-{uuid.uuid4().hex[:10]}",
        "task": "quadratic",
        "search_space": {
            "x": {"type": "float", "low": -5.0, "high": 5.0},
            "lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True},
            "n": {"type": "int", "low": 1, "high": 8, "log": True},
            "width": {"type": "int", "low": 16, "high": 128, "step": 16},
            "act": {"type": "categorical", "choices": ["relu", "gelu", None, 3, True]},
        },
        "sampler": {"name": "random", "args": {"seed": 7}},
        "n_trials": 4,
    }
    body.update(overrides)
    return body


EXPECTED_SPACE = {
    "x": FloatDistribution(-5.0, 5.0),
    "lr": FloatDistribution(1e-4, 1e-1, log=True),
    "n": IntDistribution(1, 8, log=True),
    "width": IntDistribution(16, 128, step=16),
    "act": CategoricalDistribution(["relu", "gelu", None, 3, True]),
}


def create(api: httpx.Client, **overrides: Any) -> dict[str, Any]:
    """Create a study and return its summary."""
    response = api.post("studies", json=spec(**overrides))
    assert response.status_code == 201, response.text
    return dict(response.json())


def vramtune_rows(engine: Engine, name: str) -> int:
    """How many vramtune_studies rows carry this name."""
    with engine.connect() as connection:
        return int(connection.scalar(select(func.count()).where(StudyRow.name == name)) or 0)


def in_optuna(storage: RDBStorage, name: str) -> bool:
    """Whether plain Optuna sees a study of this name."""
    return name in optuna.study.get_all_study_names(storage=storage)


# ---------------------------------------------------------------- create, get, list


def test_create_get_list(api: httpx.Client, plain: RDBStorage, engine: Engine) -> None:
    summary = create(api)
    assert summary["state"] == "running"
    assert summary["directions"] == ["minimize"]
    assert summary["counts"] == {s.name: 0 for s in TrialState}
    assert summary["best_value"] is None
    assert summary["spec"]["sampler"] == {"name": "random", "args": {"seed": 7}}
    assert api.get(f"studies/{summary['name']}").json() == summary
    listed = api.get("studies").json()["studies"]
    assert summary in listed
    assert vramtune_rows(engine, summary["name"]) == 1
    assert in_optuna(plain, summary["name"])


def test_distributed_policy_round_trips_with_defaults(api: httpx.Client) -> None:
    made = create(api, distributed={"max_world_size": 4})
    defaults = {"strategies": ["ddp", "fsdp"], "max_world_size": 4, "prefer": "fewest_cards"}
    assert made["spec"]["distributed"] == defaults
    assert create(api)["spec"]["distributed"] is None  # one card a trial unless asked
    fastest = create(api, distributed={"prefer": "fastest"})["spec"]["distributed"]
    assert fastest["prefer"] == "fastest"
    assert api.get(f"studies/{made['name']}").json()["spec"]["distributed"] == defaults


def test_json_types_survive(api: httpx.Client) -> None:
    space = {"flag": {"type": "categorical", "choices": [True, 2, 2.5, "2"]}}
    sampler = {"name": "tpe", "args": {"multivariate": True, "prior_weight": 1.0, "seed": 3}}
    stored = create(api, search_space=space, sampler=sampler)["spec"]
    choices = stored["search_space"]["flag"]["choices"]
    assert [type(c) for c in choices] == [bool, int, float, str]
    assert [type(v) for v in stored["sampler"]["args"].values()] == [bool, float, int]


def test_peak_memory_is_a_second_objective(api: httpx.Client) -> None:
    summary = create(api, directions=["maximize"], minimize_peak_memory=True)
    assert summary["directions"] == ["maximize", "minimize"]
    two = create(api, directions=["minimize", "maximize"], sampler={"name": "nsga2"})
    assert two["directions"] == ["minimize", "maximize"]


def test_study_readable_by_plain_optuna(api: httpx.Client, url: str) -> None:
    name = create(api, directions=["maximize"])["name"]
    study = optuna.load_study(study_name=name, storage=url)  # a URL, as a user would
    assert study.directions == [optuna.study.StudyDirection.MAXIMIZE]
    stored = study.user_attrs[SEARCH_SPACE_ATTR]
    assert {k: json_to_distribution(v) for k, v in stored.items()} == EXPECTED_SPACE
    assert study.user_attrs[TASK_ATTR] == "quadratic"
    trial = study.ask(fixed_distributions=EXPECTED_SPACE)
    assert trial.distributions == EXPECTED_SPACE
    study.tell(trial, 2.5)
    study._storage._backend.engine.dispose()  # type: ignore[attr-defined]
    summary = api.get(f"studies/{name}").json()
    assert summary["counts"]["COMPLETE"] == 1
    assert summary["best_value"] == 2.5
    (out,) = api.get(f"studies/{name}/trials").json()["trials"]
    assert out["state"] == "COMPLETE"
    assert out["values"] == [2.5]
    assert out["params"] == trial.params


# ---------------------------------------------------------------- bad input


BAD_INPUT: list[tuple[str, dict[str, Any], str]] = [
    ("low>high", {"search_space": {"x": {"type": "float", "low": 1, "high": 0}}}, "search_space.x"),
    (
        "low=high",
        {"search_space": {"x": {"type": "float", "low": 1, "high": 1}}},
        "search_space.x.high",
    ),
    (
        "int low=high",
        {"search_space": {"k": {"type": "int", "low": 3, "high": 3}}},
        "search_space.k.high",
    ),
    (
        "log low<=0",
        {"search_space": {"x": {"type": "float", "low": 0, "high": 1, "log": True}}},
        "search_space.x",
    ),
    (
        "empty choices",
        {"search_space": {"c": {"type": "categorical", "choices": []}}},
        "search_space.c",
    ),
    (
        "unknown type",
        {"search_space": {"x": {"type": "normal", "low": 0, "high": 1}}},
        "search_space.x",
    ),
    ("empty space", {"search_space": {}}, "search_space"),
    ("unknown sampler", {"sampler": {"name": "annealing"}}, "sampler.name"),
    ("unknown pruner", {"pruner": {"name": "oracle"}}, "pruner.name"),
    (
        "unknown sampler arg",
        {"sampler": {"name": "tpe", "args": {"bogus": 1}}},
        "sampler.args.bogus",
    ),
    (
        "mistyped sampler arg",
        {"sampler": {"name": "tpe", "args": {"n_startup_trials": "ten"}}},
        "sampler.args.n_startup_trials",
    ),
    (
        "sampler arg out of range",
        {"sampler": {"name": "nsga2", "args": {"population_size": 1}}},
        "sampler.args",
    ),
    (
        "code as sampler arg",
        {"sampler": {"name": "tpe", "args": {"gamma": "lambda n: n"}}},
        "sampler.args.gamma",
    ),
    (
        "pruner arg out of range",
        {"pruner": {"name": "percentile", "args": {"percentile": 150}}},
        "pruner.args",
    ),
    (
        "bad wrapped pruner",
        {
            "pruner": {
                "name": "patient",
                "args": {"patience": 2, "wrapped_pruner": {"name": "nope"}},
            }
        },
        "pruner.args.wrapped_pruner",
    ),
    ("grid on a continuous space", {"sampler": {"name": "grid"}}, "sampler.name"),
    ("no directions", {"directions": []}, "directions"),
    ("three directions", {"directions": ["minimize"] * 3}, "directions"),
    ("unknown direction", {"directions": ["sideways"]}, "directions"),
    (
        "peak memory with two",
        {"directions": ["minimize", "minimize"], "minimize_peak_memory": True},
        "body",
    ),
    ("bad name", {"name": "no spaces please"}, "name"),
    # Multi-GPU trials (docs/concepts/multi-gpu.md): how a trial may be spread over cards.
    (
        "unknown strategy",
        {"distributed": {"strategies": ["ddp", "zero3"]}},
        "distributed.strategies",
    ),
    (
        "strategy twice",
        {"distributed": {"strategies": ["fsdp", "fsdp"]}},
        "distributed.strategies",
    ),
    ("no strategy", {"distributed": {"strategies": []}}, "distributed.strategies"),
    ("world size 0", {"distributed": {"max_world_size": 0}}, "distributed.max_world_size"),
    ("world size 65", {"distributed": {"max_world_size": 65}}, "distributed.max_world_size"),
    ("unknown distributed key", {"distributed": {"nodes": 2}}, "distributed.nodes"),
    ("unknown preference", {"distributed": {"prefer": "cheapest"}}, "distributed.prefer"),
    ("unknown field", {"colour": "blue"}, "colour"),
    (
        "unknown rung",
        {"memory_policy": {"resizes": ["adafactor", "adamw_8bit", "offload_everything"]}},
        "memory_policy.resizes.2",
    ),
    (
        "misspelt offload rung",
        {"memory_policy": {"resizes": ["activation_offload", "optimiser_offload"]}},
        "memory_policy.resizes.1",
    ),
    # Built-in model families: what the server can tell without torch (service/task_rules.py).
    (
        "hf heads do not divide the width",
        {
            "task": "hf-causal-lm",
            "task_config": {"hidden_size": 96},
            "search_space": {"num_attention_heads": {"type": "categorical", "choices": [4, 5]}},
        },
        "search_space.num_attention_heads",
    ),
    (
        "hf unknown model type",
        {"task": "hf-causal-lm", "task_config": {"model_type": "bert"}},
        "task_config.model_type",
    ),
    (
        "image resolution too small",
        {
            "task": "timm-image",
            "search_space": {"resolution": {"type": "categorical", "choices": [8, 64]}},
        },
        "search_space.resolution",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "field"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT]
)
def test_bad_input_names_the_field_and_leaves_nothing(
    in_process: TestClient,
    plain: RDBStorage,
    engine: Engine,
    overrides: dict[str, Any],
    field: str,
) -> None:
    # In process only: the HTTP transport adds nothing to validation (test_bad_input_over_http).
    body = spec(**overrides)
    response = in_process.post("studies", json=body)
    assert response.status_code == 422, response.text
    locs = [".".join(str(p) for p in error["loc"]) for error in response.json()["detail"]]
    assert any(field in loc for loc in locs), locs
    name = body["name"] if isinstance(body["name"], str) else ""
    assert vramtune_rows(engine, name) == 0
    assert not in_optuna(plain, name)


def test_bad_input_over_http(api: httpx.Client, plain: RDBStorage, engine: Engine) -> None:
    body = spec(sampler={"name": "tpe", "args": {"seed": "x"}})
    response = api.post("studies", json=body)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "sampler", "args", "seed"]
    assert vramtune_rows(engine, body["name"]) == 0
    assert not in_optuna(plain, body["name"])


def test_duplicate_name_is_409_and_keeps_the_first(api: httpx.Client, engine: Engine) -> None:
    first = create(api)
    again = api.post("studies", json=spec(name=first["name"], task="other"))
    assert again.status_code == 409
    assert first["name"] in again.json()["detail"]
    assert api.get(f"studies/{first['name']}").json()["task"] == "quadratic"
    assert vramtune_rows(engine, first["name"]) == 1


def test_name_taken_by_a_plain_optuna_study_is_409(
    api: httpx.Client, plain: RDBStorage, engine: Engine
) -> None:
    name = f"plain-{uuid.uuid4().hex[:8]}"
    optuna.create_study(study_name=name, storage=plain)
    response = api.post("studies", json=spec(name=name))
    assert response.status_code == 409
    assert vramtune_rows(engine, name) == 0
    assert optuna.load_study(study_name=name, storage=plain).user_attrs == {}


def test_malformed_json_is_422(api: httpx.Client) -> None:
    response = api.post(
        "studies", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert "detail" in response.json()


def test_unknown_study_is_404(api: httpx.Client) -> None:
    for method, path in [
        ("GET", ""),
        ("GET", "/trials"),
        ("GET", "/best"),
        ("POST", "/pause"),
        ("DELETE", ""),
    ]:
        response = api.request(method, f"studies/missing-study{path}")
        assert response.status_code == 404, (method, path)
        assert "missing-study" in response.json()["detail"]


# ---------------------------------------------------------------- trials, best, Pareto front


def run_plain_trials(
    storage: RDBStorage, name: str, outcomes: list[float | TrialState]
) -> list[int]:
    """Ask and tell trials with plain Optuna (a stand-in for workers); returns trial ids."""
    study = optuna.load_study(study_name=name, storage=storage)
    ids = []
    for outcome in outcomes:
        trial = study.ask(fixed_distributions=EXPECTED_SPACE)
        ids.append(trial._trial_id)
        if isinstance(outcome, TrialState):
            if outcome != TrialState.RUNNING:
                study.tell(trial, state=outcome)
        else:
            study.tell(trial, outcome)
    return ids


def test_trials_pagination_and_state_filter(api: httpx.Client, plain: RDBStorage) -> None:
    name = create(api, n_trials=10)["name"]
    outcomes: list[float | TrialState] = [3.0, TrialState.FAIL, 1.0, TrialState.RUNNING, 2.0]
    run_plain_trials(plain, name, outcomes)
    page = api.get(f"studies/{name}/trials", params={"offset": 1, "limit": 2}).json()
    assert [t["number"] for t in page["trials"]] == [1, 2]
    assert (page["total"], page["offset"], page["limit"]) == (5, 1, 2)
    complete = api.get(f"studies/{name}/trials", params={"state": "COMPLETE"}).json()
    assert [t["values"] for t in complete["trials"]] == [[3.0], [1.0], [2.0]]
    mixed = api.get(
        f"studies/{name}/trials", params=[("state", "FAIL"), ("state", "RUNNING")]
    ).json()
    assert [t["state"] for t in mixed["trials"]] == ["FAIL", "RUNNING"]
    assert api.get(f"studies/{name}/best").json()["trials"][0]["values"] == [1.0]
    summary = api.get(f"studies/{name}").json()
    assert (
        summary["counts"]["COMPLETE"],
        summary["counts"]["FAIL"],
        summary["counts"]["RUNNING"],
    ) == (3, 1, 1)
    assert summary["best_value"] == 1.0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"state": "DONE"}, "state"),
        ({"limit": 0}, "limit"),
        ({"limit": 5000}, "limit"),
        ({"offset": -1}, "offset"),
    ],
)
def test_bad_trial_query_is_422(api: httpx.Client, params: dict[str, Any], field: str) -> None:
    name = create(api)["name"]
    response = api.get(f"studies/{name}/trials", params=params)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][:2] == ["query", field]


def test_trials_carry_vramtune_fields(api: httpx.Client, plain: RDBStorage, engine: Engine) -> None:
    summary = create(api)
    (trial_id,) = run_plain_trials(plain, summary["name"], [0.5])
    now = datetime(2026, 1, 1)
    with Session(engine) as session, session.begin():
        worker = WorkerRow(
            name="gpu-a",
            device="cuda:0",
            card_model="NVIDIA H200",
            total_bytes=2**37,
            free_bytes=2**37,
            card={},
            constants={},
            tasks=["quadratic"],
            registered_at=now,
            last_heartbeat=now,
            stopped=False,
            trials_done=1,
        )
        session.add(worker)
        session.flush()
        session.add(
            TrialRow(
                trial_id=trial_id,
                study_id=summary["id"],
                number=0,
                status="done",
                attempt=2,
                min_bytes=0,
                outcome="resized",
                worker_id=worker.id,
                plans_tried=[],
                plan={"micro_batch": 4, "accumulation": 8, "checkpointing": True, "reason": "fit"},
                predicted_peak_bytes=1000,
                measured_peak_bytes=990,
                updated_at=now,
            )
        )
    (out,) = api.get(f"studies/{summary['name']}/trials").json()["trials"]
    assert (out["attempt"], out["outcome"], out["worker"], out["card_model"]) == (
        2,
        "resized",
        "gpu-a",
        "NVIDIA H200",
    )
    assert out["plan"] == {
        "micro_batch": 4,
        "accumulation": 8,
        "checkpointing": True,
        "checkpoint_blocks": None,  # every block (selective checkpointing: the first k)
        "chunked_loss": False,
        "bf16": False,
        "reason": "fit",
    }
    assert (out["predicted_peak_bytes"], out["measured_peak_bytes"]) == (1000, 990)
    assert api.get(f"studies/{summary['name']}/best").json()["trials"][0]["worker"] == "gpu-a"


def test_pareto_front(api: httpx.Client, plain: RDBStorage) -> None:
    name = create(api, directions=["minimize", "minimize"], sampler={"name": "random"})["name"]
    study = optuna.load_study(study_name=name, storage=plain)
    for values in ([1.0, 4.0], [2.0, 2.0], [3.0, 3.0], [4.0, 1.0]):
        study.add_trial(optuna.trial.create_trial(params={}, distributions={}, values=values))
    front = api.get(f"studies/{name}/best").json()["trials"]
    assert sorted(t["values"] for t in front) == [[1.0, 4.0], [2.0, 2.0], [4.0, 1.0]]
    assert api.get(f"studies/{name}").json()["best_value"] is None


def test_best_is_empty_before_any_trial(api: httpx.Client) -> None:
    name = create(api)["name"]
    assert api.get(f"studies/{name}/best").json() == {"trials": []}


# ---------------------------------------------------------------- life cycle


def test_pause_resume_and_done(api: httpx.Client, plain: RDBStorage) -> None:
    name = create(api, n_trials=2)["name"]
    assert api.post(f"studies/{name}/pause").json()["state"] == "paused"
    assert api.get(f"studies/{name}").json()["state"] == "paused"
    assert api.post(f"studies/{name}/resume").json()["state"] == "running"
    run_plain_trials(plain, name, [1.0, TrialState.PRUNED])
    assert api.get(f"studies/{name}").json()["state"] == "done"


def test_delete_removes_optuna_and_vramtune_rows(
    api: httpx.Client, plain: RDBStorage, engine: Engine
) -> None:
    summary = create(api)
    (trial_id,) = run_plain_trials(plain, summary["name"], [TrialState.RUNNING])
    with Session(engine) as session, session.begin():
        session.add(
            TrialRow(
                trial_id=trial_id,
                study_id=summary["id"],
                number=0,
                status="pending",
                attempt=1,
                min_bytes=0,
                plans_tried=[],
                updated_at=datetime(2026, 1, 1),
            )
        )
    assert api.delete(f"studies/{summary['name']}").status_code == 204
    assert api.get(f"studies/{summary['name']}").status_code == 404
    assert not in_optuna(plain, summary["name"])
    assert vramtune_rows(engine, summary["name"]) == 0
    with engine.connect() as connection:
        assert connection.scalar(select(func.count()).where(TrialRow.trial_id == trial_id)) == 0
        assert connection.scalar(select(func.count()).where(LeaseRow.trial_id == trial_id)) == 0
    assert summary["name"] not in [s["name"] for s in api.get("studies").json()["studies"]]
    recreated = create(api, name=summary["name"])
    assert recreated["counts"]["RUNNING"] == 0


def test_health(api: httpx.Client) -> None:
    assert api.get("health").json() == {"status": "ok"}
