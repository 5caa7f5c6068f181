"""Browser fixtures: a live server with studies run by real CPU workers, and headless Chromium.

One server and one pair of workers serve every browser test of the session (starting them and
running the study takes most of the time); each test opens its own page.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import optuna
import pytest
from sqlalchemy.orm import Session

from tests.browser.chromium import CHROMIUM, launch
from tests.e2e.conftest import WorkerProcess
from vramtune.service.auth import tokens as auth
from vramtune.service.client import Client
from vramtune.service.db.engine import make_engine
from vramtune.service.state import utcnow
from vramtune.service.testing import (
    ServerProcess,
    fresh_postgres_database,
    server_factory,
    sqlite_url,
    upgrade_database,
)

REPO = Path(__file__).resolve().parents[2]

ARTIFACTS = REPO / "test-artifacts"
# A failure bound for things that take seconds, never an assertion on time.
PATIENCE_S = 150.0
# Heartbeats every 2 s: a worker shows as stale after 5 s without one.
FLEET = {"heartbeat_interval_s": 2.0}
STUDY = "dash-quadratic"
# Two objectives (the quadratic, minimized; the distance to the origin, maximized).
MO_STUDY = "dash-two-objectives"
MO_TRIALS = 16
XSS_PARAM_STUDY = "dash-xss-params"
# Names that would run script if a page ever put them into innerHTML.
XSS_PARAM = '<img src=x onerror="window.__xss=1">'
XSS_STUDY = "<script>window.__xss=1</script>"
N_TRIALS = 30
METRIC = "quadratic loss"  # the metric name STUDY's axes are titled with


def quadratic_spec(name: str, n_trials: int, **extra: Any) -> dict[str, Any]:
    """A quadratic study whose widths and batches make trials fit, resize, route, OOM or not fit.

    On a 64 MiB card only narrow models fit; width 1024 must go to the 256 MiB card; width 4096
    fits no card (infeasible); micro-batches above 192 run out of memory though predicted to fit.
    """
    spec = {
        "name": name,
        "task": "quadratic",
        "search_space": {
            "x": {"type": "float", "low": -2.0, "high": 3.0},
            "y": {"type": "float", "low": -2.0, "high": 2.0},
            "batch_size": {"type": "categorical", "choices": [32, 64, 128, 256]},
            "width": {"type": "categorical", "choices": [64, 256, 1024, 4096]},
        },
        "sampler": {"name": "random", "args": {"seed": 3}},
        "pruner": {"name": "median", "args": {"n_startup_trials": 8}},
        "n_trials": n_trials,
        "budget": {"max_steps": 20, "eval_every": 4},
        "task_config": {"step_seconds": 0.002, "oom_above_micro_batch": 192},
        "memory_policy": {"resizes": ["micro_batch", "checkpointing"]},
    }
    return spec | extra


def two_objective_spec() -> dict[str, Any]:
    """The quadratic (minimized) and the distance to the origin (maximized); no pruning."""
    spec = quadratic_spec(MO_STUDY, MO_TRIALS, directions=["minimize", "maximize"])
    spec["task_config"] = spec["task_config"] | {"objectives": 2}
    return spec | {"pruner": {"name": "none"}}


@dataclass
class Live:
    """The live server (auth on), its database, its tokens by scope."""

    server: ServerProcess
    database_url: str
    workers: list[WorkerProcess]
    directory: Path
    client: Client
    tokens: dict[str, str]

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self.server.url


def make_tokens(url: str) -> dict[str, str]:
    """One token per scope, written to the database as `vramtune token create` would."""
    engine = make_engine(url)
    try:
        with Session(engine) as session, session.begin():
            return {
                s: auth.create_token(session, f"browser-{s}", [s], utcnow())[1] for s in auth.SCOPES
            }
    finally:
        engine.dispose()


def auth_server(
    stack: ExitStack, database: str, directory: Path
) -> tuple[ServerProcess, dict[str, str]]:
    """A server with auth on over a fresh migrated database ("sqlite" or "postgresql"), and a
    token per scope; both go when `stack` closes."""
    url = (
        sqlite_url(directory)
        if database == "sqlite"
        else stack.enter_context(fresh_postgres_database())
    )
    upgrade_database(url)
    tokens = make_tokens(url)
    return stack.enter_context(server_factory(directory))(url, auth="on", **FLEET), tokens


def wait_for(check: Callable[[], bool], what: str, timeout: float = PATIENCE_S) -> None:
    """Poll ``check`` until true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.3)


def finished(client: Client, name: str) -> bool:
    """Whether the study has run all its trials."""
    return client.get_study(name).state == "done"


def seed_plain_optuna_study(url: str, name: str) -> None:
    """A study made by plain Optuna in the same database, its name and parameter hostile."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=url, study_name=name)
    study.optimize(lambda t: t.suggest_float("<b>bold</b>", 0, 1) ** 2, n_trials=3)


@pytest.fixture(scope="session")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A server with auth on, two CPU workers (64 and 256 MiB cards), two finished studies."""
    directory = tmp_path_factory.mktemp("dashboard")
    url = upgrade_database(sqlite_url(directory))
    tokens = make_tokens(url)
    with server_factory(directory) as start:
        server = start(url, auth="on", **FLEET)
        with Client(server.url, token=tokens["admin"]) as client:
            client.create_study(quadratic_spec(STUDY, N_TRIALS, metric_names=[METRIC]))
            client.create_study(two_objective_spec())
            hostile = quadratic_spec(XSS_PARAM_STUDY, 3)
            hostile["search_space"] = {XSS_PARAM: {"type": "float", "low": 0.0, "high": 1.0}}
            client.create_study(hostile)
            seed_plain_optuna_study(url, XSS_STUDY)
            worker_token = ("--token", tokens["worker"])
            workers = [
                WorkerProcess(server.url, "64MiB", directory / "small-card.log", *worker_token),
                WorkerProcess(server.url, "256MiB", directory / "large-card.log", *worker_token),
            ]
            live = Live(server, url, workers, directory, client, tokens)
            try:
                for name in (STUDY, MO_STUDY):
                    wait_for(partial(finished, client, name), f"{name} to finish")
                yield live
            finally:
                for worker in workers:
                    worker.stop()
                    print(f"----- {worker.name}\n{worker.logs()[-4000:]}")


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Chromium from the Debian package (never a downloaded one)."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    with launch() as browser:
        yield browser


@dataclass
class Page:
    """A browser page that records console errors, uncaught exceptions and dialogs."""

    page: Any
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def screenshot(self, name: str, full_page: bool = True) -> Path:
        """A screenshot (of the whole page, or of what the window shows) under test-artifacts/."""
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=full_page)
        return path


OpenPage = Callable[..., Page]


@pytest.fixture
def open_page(browser: Any, live: Live) -> Iterator[OpenPage]:
    """open_page(url, token="admin") -> Page in a fresh browser context; token=None: signed out.

    The token is put in the tab's sessionStorage, where the login box keeps it.
    """
    contexts: list[Any] = []

    def open_(url: str, token: str | None = "admin") -> Page:
        context = browser.new_context(viewport={"width": 1500, "height": 1000})
        contexts.append(context)
        if token is not None:
            value = json.dumps(live.tokens[token])
            context.add_init_script(f"sessionStorage.setItem('vramtune.token', {value})")
        page = Page(context.new_page())
        page.page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
        page.page.on("pageerror", lambda e: page.errors.append(f"uncaught: {e}"))
        page.page.on("dialog", lambda d: (page.dialogs.append(d.message), d.dismiss()))
        page.page.goto(url)
        return page

    yield open_
    for context in contexts:
        context.close()
