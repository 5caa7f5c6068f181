"""A shared fleet's server against hostile input (issue 30): bounded sampler and pruner
arguments, nesting, static file names, Host headers and worker validation, on a real server."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from security_fixtures import migrated_sqlite, study_spec

from vramtune.service.dashboard import pages
from vramtune.service.optuna.arguments import PRUNER_BOUNDS, SAMPLER_BOUNDS
from vramtune.service.optuna.glue import _PRUNERS, _SAMPLERS
from vramtune.service.testing import ServerProcess, server_factory

API = "/api/v1"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A real server (uvicorn subprocess), auth off as in the demo, on a migrated SQLite file."""
    directory = Path(tmp_path_factory.mktemp("shared_fleet"))
    with server_factory(directory) as start:
        yield start(migrated_sqlite(directory))


def study_names(server: ServerProcess) -> set[str]:
    """Names of the studies the server lists."""
    response = httpx.get(f"{server.url}{API}/studies", timeout=30)
    assert response.status_code == 200, response.text
    return {study["name"] for study in response.json()["studies"]}


def assert_422_naming(response: httpx.Response, *loc: str) -> None:
    """A 422 whose detail names the field at loc."""
    assert response.status_code == 422, response.text
    locations = [error["loc"][: len(loc) + 1] for error in response.json()["detail"]]
    assert ["body", *loc] in locations, response.text


def create(server: ServerProcess, **overrides: Any) -> httpx.Response:
    """POST a study of the quadratic task with these fields replaced."""
    body = {**study_spec(str(overrides.pop("name", "bounded"))), **overrides}
    return httpx.post(f"{server.url}{API}/studies", json=body, timeout=60)


# ---------------------------------------------------------------- 4: bounded arguments

WRAPPED_TOO_MANY = {"name": "median", "args": {"n_startup_trials": 10**9}}
# (sampler or pruner, its name, its args, the field the 422 names under <kind>.args)
OUT_OF_BOUNDS = [
    ("sampler", "tpe", {"n_ei_candidates": 4_000_000}, "n_ei_candidates"),
    ("sampler", "tpe", {"seed": 2**40}, "seed"),
    ("sampler", "nsga2", {"population_size": 10**6}, "population_size"),
    ("sampler", "qmc", {"qmc_type": "x" * 4000}, "qmc_type"),
    ("pruner", "hyperband", {"bootstrap_count": 10**9}, "bootstrap_count"),
    ("pruner", "successive_halving", {"min_early_stopping_rate": 10**9}, "min_early_stopping_rate"),
    ("pruner", "hyperband", {"max_resource": "forever"}, "max_resource"),
    ("pruner", "patient", {"patience": 2, "wrapped_pruner": WRAPPED_TOO_MANY},
     "wrapped_pruner.args.n_startup_trials"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "name", "args", "field"), OUT_OF_BOUNDS)
def test_an_argument_out_of_bounds_is_a_422_naming_it(
    server: ServerProcess, kind: str, name: str, args: dict[str, Any], field: str
) -> None:
    """TPE's n_ei_candidates: 4000000 made one ask take 63 s; now it is refused, by name."""
    response = create(server, name="unbounded", **{kind: {"name": name, "args": args}})
    assert_422_naming(response, kind, "args", *field.split("."))
    assert "unbounded" not in study_names(server)


def test_arguments_at_their_bounds_are_accepted(server: ServerProcess) -> None:
    sampler = {"name": "tpe", "args": {"n_ei_candidates": 1024, "seed": 2**32 - 1}}
    pruner = {"name": "hyperband", "args": {"max_resource": "auto", "reduction_factor": 100}}
    response = create(server, name="at-bounds", sampler=sampler, pruner=pruner)
    assert response.status_code == 201, response.text


def test_every_bound_names_an_argument_of_its_class() -> None:
    """The table cannot drift from Optuna: each bounded name is a parameter of the class."""
    for bounds, classes in ((SAMPLER_BOUNDS, _SAMPLERS), (PRUNER_BOUNDS, _PRUNERS)):
        assert set(bounds) == set(classes)
        for name, table in bounds.items():
            parameters = inspect.signature(classes[name]).parameters
            assert set(table) <= set(parameters), (name, set(table) - set(parameters))


# ---------------------------------------------------------------- 6: nested pruners


def patient_chain(depth: int) -> dict[str, Any]:
    """A patient pruner wrapping a patient pruner ... ``depth`` times, around a median one."""
    pruner: dict[str, Any] = {"name": "median", "args": {}}
    for _ in range(depth):
        pruner = {"name": "patient", "args": {"patience": 1, "wrapped_pruner": pruner}}
    return pruner


def test_a_chain_of_150_patient_pruners_is_a_422_naming_the_field(server: ServerProcess) -> None:
    """It was a 500 ("Maximum serialization depth exceeded") after the Optuna study was made."""
    response = create(server, name="deep-pruner", pruner=patient_chain(150))
    assert_422_naming(response, "pruner", "args")
    assert "wrapped_pruner" in response.text
    assert "deep-pruner" not in study_names(server)


def test_three_wrapped_pruners_are_accepted(server: ServerProcess) -> None:
    response = create(server, name="three-deep", pruner=patient_chain(3))
    assert response.status_code == 201, response.text


def test_only_the_patient_pruner_wraps(server: ServerProcess) -> None:
    """median silently ignored a wrapped_pruner; it is refused now."""
    pruner = {"name": "median", "args": {"wrapped_pruner": {"name": "median"}}}
    assert_422_naming(create(server, name="wrapped", pruner=pruner), "pruner", "args")


# ---------------------------------------------------------------- 5: static file names


@pytest.mark.parametrize(
    "name", ["a" * 256 + ".js", "x" * 5000 + ".css", "..%2Fpages.py", "study.main.html", "nope.js"]
)
def test_a_name_that_is_not_shipped_is_a_404(server: ServerProcess, name: str) -> None:
    """An anonymous request with a 256+ character name was a 500 ("File name too long")."""
    response = httpx.get(f"{server.url}/dashboard/static/{name}", timeout=30)
    assert response.status_code == 404, response.text
    assert "detail" in response.json()


def test_shipped_assets_are_still_served(server: ServerProcess) -> None:
    for name in ("common.js", "dashboard.css", "favicon.svg", "studies.html"):
        assert httpx.get(f"{server.url}/dashboard/static/{name}", timeout=30).status_code == 200


def test_the_asset_cache_holds_shipped_files_only() -> None:
    """Every name asked for was cached; now only the shipped files can be."""
    for index in range(500):
        assert pages.asset(f"probe-{index}.js") is None
    assert pages.asset("common.js") is not None
    assert pages._load.cache_info().currsize <= len(pages.shipped_names())


# ---------------------------------------------------------------- 7: DNS rebinding


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "127.0.0.1.nip.io"])
def test_auth_off_refuses_a_foreign_host_header(server: ServerProcess, host: str) -> None:
    """A page rebound to 127.0.0.1 sends its own name as Host: it may not create or delete."""
    before = study_names(server)
    body = study_spec("rebound")
    created = httpx.post(f"{server.url}{API}/studies", json=body, headers={"Host": host})
    assert created.status_code == 400, created.text
    assert "Host" in created.json()["detail"]
    listed = httpx.get(f"{server.url}{API}/studies", headers={"Host": host})
    assert listed.status_code == 400
    assert study_names(server) == before


@pytest.mark.parametrize("forwarded", ["testclient", "testclient:50000", "127.0.0.1"])
def test_a_forwarded_for_header_does_not_pass_the_host_check(
    server: ServerProcess, forwarded: str
) -> None:
    """X-Forwarded-For, which a page script may send, named the client "testclient" through
    uvicorn's proxy headers (on for 127.0.0.1 by default) and so passed the rebinding check
    (issue 47): a rebound page created and deleted studies."""
    before = study_names(server)
    headers = {"Host": "attacker.example", "X-Forwarded-For": forwarded}
    created = httpx.post(f"{server.url}{API}/studies", json=study_spec("xff"), headers=headers)
    assert created.status_code == 400, created.text
    deleted = httpx.delete(f"{server.url}{API}/studies/{next(iter(before), 'x')}", headers=headers)
    assert deleted.status_code == 400, deleted.text
    assert study_names(server) == before


def test_proxy_headers_are_read_only_from_configured_proxies(tmp_path: Path) -> None:
    """Without trusted_proxies no X-Forwarded-For is believed; an operator's proxy is, and even
    then a forwarded "testclient" is no way past the Host check."""
    headers = {"Host": "attacker.example", "X-Forwarded-For": "testclient"}
    with server_factory(tmp_path) as start:
        server = start(migrated_sqlite(tmp_path), trusted_proxies="127.0.0.1")
        refused = httpx.get(f"{server.url}{API}/studies", headers=headers)
        assert refused.status_code == 400, refused.text
    from vramtune.service.cli.commands import proxy_options
    from vramtune.service.settings import Settings

    assert proxy_options(Settings()) == {"proxy_headers": False}
    proxied = proxy_options(Settings(trusted_proxies="10.0.0.0/8"))
    assert proxied == {"proxy_headers": True, "forwarded_allow_ips": "10.0.0.0/8"}


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "127.0.0.1", "[::1]:80"])
def test_auth_off_answers_its_own_names(server: ServerProcess, host: str) -> None:
    response = httpx.get(f"{server.url}{API}/health", headers={"Host": host})
    assert response.status_code == 200, response.text


def test_allowed_hosts_adds_names(tmp_path: Path) -> None:
    """A server reached by another name (a LAN name, with --insecure) lists it."""
    with server_factory(tmp_path) as start:
        server = start(migrated_sqlite(tmp_path), allowed_hosts="tuner.lan,localhost")
        assert httpx.get(f"{server.url}{API}/studies", headers={"Host": "tuner.lan"}).is_success
        refused = httpx.get(f"{server.url}{API}/studies", headers={"Host": "other.lan"})
        assert refused.status_code == 400
