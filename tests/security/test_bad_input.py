"""Bad input everywhere: 4xx JSON naming the field, never a 5xx or a trace, nothing half-written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from security_fixtures import Live, migrated_sqlite, study_spec
from sqlalchemy import func, select

from vramtune.service.db.tables import MAX_ROW_ID, StudyRow
from vramtune.service.limits import non_finite_number
from vramtune.service.settings import Settings
from vramtune.service.testing import IN_PROCESS_HOSTS, ServerFactory

HEADERS = {"content-type": "application/json"}


def study_count(client: TestClient) -> int:
    """Rows in vramtune_studies plus studies in Optuna's storage."""
    state = client.app.state.vt  # type: ignore[attr-defined]
    with state.sessions() as session:
        rows = int(session.scalar(select(func.count()).select_from(StudyRow)) or 0)
    return rows + len(state.storage.get_all_studies())


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """In-process app, auth off, a small body limit (8 KiB)."""
    from vramtune.service.app import create_app

    url = migrated_sqlite(Path(tmp_path_factory.mktemp("bad")))
    settings = Settings(
        database_url=url, auth="off", allowed_hosts=IN_PROCESS_HOSTS, max_request_bytes=8192
    )
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def assert_names(response: httpx.Response, status: int, *loc: str | int) -> None:
    """A JSON error of this status whose detail names the field at loc."""
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    detail = response.json()["detail"]
    if loc:
        assert [*loc] in [error["loc"][: len(loc)] for error in detail], detail


def with_space(**space: object) -> dict[str, object]:
    """A study spec with this search space."""
    return {**study_spec("s"), "search_space": space}


NON_FINITE_BODIES = [
    ('{"name":"a","task":"t","search_space":{"x":{"type":"float","low":NaN,"high":1}}}',
     ("body", "search_space", "x", "low")),
    ('{"name":"a","task":"t","search_space":{"x":{"type":"categorical","choices":[-Infinity]}}}',
     ("body", "search_space", "x", "choices", 0)),
    ('{"name":"a","task":"t","search_space":{"x":{"type":"float","low":0,"high":1e999}}}',
     ("body", "search_space", "x", "high")),
    ('{"name":"a","task":"t","task_config":{"lr":NaN},"search_space":{}}',
     ("body", "task_config", "lr")),
]  # fmt: skip


@pytest.mark.parametrize(("body", "loc"), NON_FINITE_BODIES)
def test_non_finite_numbers_are_422_naming_the_field(
    client: TestClient, body: str, loc: tuple[str | int, ...]
) -> None:
    """Python's JSON parser takes NaN and 1e999 (inf); the service refuses them, by name."""
    before = study_count(client)
    response = client.post("/api/v1/studies", content=body, headers=HEADERS)
    assert_names(response, 422, *loc)
    assert study_count(client) == before


def test_non_finite_numbers_on_the_worker_protocol(client: TestClient) -> None:
    """The same at the worker routes: a NaN metric is a 422, not a 500."""
    body = '{"lease":"0123456789abcdef","step":1,"value":NaN}'
    response = client.post("/api/v1/trials/1/report", content=body, headers=HEADERS)
    assert_names(response, 422, "body", "value")


BAD_SPECS = [
    ({"name": "<script>alert(1)</script>"}, ("body", "name")),
    ({"name": "x" * 129}, ("body", "name")),
    ({"task": "../../etc/passwd"}, ("body", "task")),
    (with_space(**{f"p{i}": {"type": "int", "low": 0, "high": 1} for i in range(65)}),
     ("body", "search_space")),
    (with_space(c={"type": "categorical", "choices": list(range(257))}),
     ("body", "search_space", "c")),
    (with_space(x={"type": "float", "low": -1e308, "high": 1e308}), ("body", "search_space", "x")),
    (with_space(x={"type": "float", "low": 0, "high": 1e300, "step": 1e-300}),
     ("body", "search_space", "x")),
    (with_space(x={"type": "int", "low": 0, "high": 2**60}), ("body", "search_space", "x")),
    ({"task_config": {"k": "v" * 5000}}, ("body", "task_config", "k")),
    ({"task_config": {"k": [1, 2]}}, ("body", "task_config", "k")),
    ({"sampler": {"name": "tpe", "args": {"seed": {"nested": 1}}}},
     ("body", "sampler", "args", "seed")),
    ({"n_trials": 10**7}, ("body", "n_trials")),
    # issue 47: each rung once (70,000 entries were stored and sent with every assignment;
    # 12 is past the 9 rungs there are)
    ({"memory_policy": {"resizes": ["micro_batch"] * 12}}, ("body", "memory_policy", "resizes")),
    ({"memory_policy": {"resizes": ["bf16", "micro_batch", "bf16"]}},
     ("body", "memory_policy", "resizes")),
    # issue 47: a bad choice past the first 4,096 combinations of a family's search space
    ({"task": "hf-causal-lm", "search_space": {
        "quantized_base": {"type": "categorical", "choices": ["none", "bogus"]},
        **{f"z{i}": {"type": "categorical", "choices": list(range(n))}
           for i, n in enumerate((17, 16, 16))}}},
     ("body", "search_space", "quantized_base")),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "loc"), BAD_SPECS)
def test_bad_study_specs_name_the_field_and_write_nothing(
    client: TestClient, overrides: dict[str, object], loc: tuple[str | int, ...]
) -> None:
    """Names, lengths, search-space sizes and ranges are bounded; a refusal leaves no study."""
    before = study_count(client)
    response = client.post("/api/v1/studies", json={**study_spec("s"), **overrides})
    assert_names(response, 422, *loc)
    assert study_count(client) == before


def test_byte_counts_are_bounded(client: TestClient) -> None:
    """Bytes are 0..10**18: a negative or a zettabyte card is refused by field."""
    card = {"model": "m", "total_bytes": 10**21, "free_bytes": -1}
    body = {"name": "w", "device": "cpu", "card": card, "tasks": ["quadratic"]}
    response = client.post("/api/v1/workers", json=body)
    assert_names(response, 422, "body", "card", "total_bytes")
    assert_names(response, 422, "body", "card", "free_bytes")


@pytest.mark.parametrize(
    "path",
    ["/api/v1/trials/99999999999999999999999/start", "/api/v1/workers/-1/heartbeat",
     "/api/v1/tokens/99999999999999999999999"],
)  # fmt: skip
def test_out_of_range_ids_are_4xx(client: TestClient, path: str) -> None:
    """An id SQLite could not even bind is a 4xx, not an OverflowError."""
    method = "DELETE" if "tokens" in path else "POST"
    response = client.request(method, path, json={})
    assert 400 <= response.status_code < 500, response.text


# Every path or query parameter that is a row's id, with a body the route takes.
ROW_ID_PARAMETERS = [
    ("POST", "/api/v1/trials/{id}/start", {"lease": "x" * 16, "plan": {}}, ("path", "trial_id")),
    ("POST", "/api/v1/workers/{id}/heartbeat", {}, ("path", "worker_id")),
    ("POST", "/api/v1/workers/{id}/next", {"free_bytes": 1}, ("path", "worker_id")),
    ("POST", "/api/v1/workers/{id}/stop", None, ("path", "worker_id")),
    ("DELETE", "/api/v1/tokens/{id}", None, ("path", "token_id")),
    ("GET", "/api/v1/audit?before={id}", None, ("query", "before")),
    (
        "GET",
        "/api/v1/calibration?card_model=m&torch_version=t&task=q&worker_id={id}",
        None,
        ("query", "worker_id"),
    ),
    ("GET", "/api/v1/dashboard/studies/s/trials/{id}", None, ("path", "number")),
]


def test_row_ids_past_postgresqls_integer_are_422_naming_the_parameter(
    migrated_url: str, start_server: ServerFactory
) -> None:
    """2**31 and 2**63 are a 422 naming the parameter on both databases (PostgreSQL's INTEGER
    overflowed into a 500); the largest id it holds is an ordinary miss."""
    server = start_server(migrated_url)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for method, path, body, loc in ROW_ID_PARAMETERS:
            for huge in (MAX_ROW_ID + 1, 2**63):
                response = http.request(method, path.format(id=huge), json=body)
                assert_names(response, 422, *loc)
            largest = http.request(method, path.format(id=MAX_ROW_ID), json=body)
            assert largest.status_code in (200, 404), (path, largest.text)


def test_body_over_the_limit_is_413_and_writes_nothing(client: TestClient) -> None:
    """Declared or streamed (chunked, no Content-Length), a large body never reaches a route."""
    before = study_count(client)
    big = {**study_spec("big"), "task_config": {f"k{i}": "v" * 200 for i in range(60)}}
    declared = client.post("/api/v1/studies", json=big)
    assert declared.status_code == 413 and "body" in declared.json()["detail"]

    def chunks() -> Iterator[bytes]:
        yield b'{"name": "big", "task": "quadratic", "task_config": {"k": "'
        for _ in range(10):
            yield b"v" * 1000
        yield b'"}}'

    streamed = client.post("/api/v1/studies", content=chunks(), headers=HEADERS)
    assert streamed.status_code == 413, streamed.text
    assert study_count(client) == before
    assert client.post("/api/v1/studies", json=study_spec("small")).status_code == 201


def test_body_limit_over_a_real_server(live: Live) -> None:
    """Through uvicorn (4 KiB limit): an oversized body is a JSON 413; a normal one works."""
    url = f"{live.server.url}/api/v1/studies"
    big = {**study_spec("big"), "task_config": {"k": "v" * 4000}}
    response = httpx.post(url, json=big, headers=live.headers())
    assert response.status_code == 413 and response.headers["content-type"] == "application/json"
    assert httpx.post(url, json=study_spec("ok"), headers=live.headers()).status_code == 201
    names = [s["name"] for s in httpx.get(url, headers=live.headers()).json()["studies"]]
    assert "ok" in names and "big" not in names


def test_non_finite_scan_finds_the_path() -> None:
    """The scanner behind the 422s: paths into objects and lists; non-JSON is left alone."""
    assert non_finite_number(b'{"a": [1, {"b": NaN}]}') == ["a", 1, "b"]
    assert non_finite_number(b'{"a": 1e308, "b": "NaN"}') is None
    assert non_finite_number(b"not json") is None
    assert non_finite_number(b"[" * 100_000) is None


def _spec_with(space: dict[str, object], sampler: str) -> dict[str, object]:
    return {
        **study_spec(f"space-{sampler}-{len(space)}"),
        "search_space": space,
        "sampler": {"name": sampler},
    }


HUGE_GRID = {
    "n": {"type": "int", "low": 0, "high": 10**6},
    "lr": {"type": "float", "low": 0.0, "high": 1.0, "step": 1e-6},
}
CHOICES = {f"c{i}": {"type": "categorical", "choices": list(range(20))} for i in range(4)}


@pytest.mark.parametrize(
    ("space", "sampler"),
    [
        (HUGE_GRID, "grid"),
        (CHOICES, "tpe"),
        ({"n": {"type": "int", "low": 0, "high": 10**6}}, "grid"),
    ],
    ids=["int-and-fine-float-grid", "categorical-combinations", "one-large-int-grid"],
)
def test_a_search_space_over_the_limit_is_422_naming_it(
    client: TestClient, space: dict[str, object], sampler: str
) -> None:
    """Grid over max_search_space_points, or categorical combinations over it: 422 naming the
    limit and its setting, nothing written."""
    before = study_count(client)
    response = client.post("/api/v1/studies", json=_spec_with(space, sampler))
    assert response.status_code == 422, response.text
    error = response.json()["detail"][0]
    assert error["loc"] == ["body", "search_space"]
    assert "100000" in error["msg"] and "VRAMTUNE_MAX_SEARCH_SPACE_POINTS" in error["msg"]
    assert study_count(client) == before


def test_a_search_space_within_the_limit_is_accepted(client: TestClient) -> None:
    """The same fine float is fine for a sampler that never enumerates it; a small grid too."""
    fine = _spec_with(HUGE_GRID, "random")
    assert client.post("/api/v1/studies", json=fine).status_code == 201
    small = {
        "a": {"type": "int", "low": 0, "high": 99},
        "b": {"type": "categorical", "choices": [1, 2]},
    }
    assert client.post("/api/v1/studies", json=_spec_with(small, "grid")).status_code == 201
