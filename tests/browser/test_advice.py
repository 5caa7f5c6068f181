"""The study page's "what to do next" panel and each trial's story, in headless Chromium.

Each advice is shown on a real study that produces it, run by real CPU workers (64 and 256 MiB
cards) on a real server, on SQLite and on PostgreSQL:

- routed then pruned: every configuration is too wide for the 64 MiB card, runs resized on the
  256 MiB one and is pruned at its first report;
- infeasible: width 4096 fits no card;
- a biased calibration: the task holds memory predict() does not see (as an unchunked
  evaluation would), the same amount whatever the configuration;
- no worker for the task: a study of a task no worker has.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import quote

import pytest

from tests.browser.conftest import (
    Page,
    auth_server,
    finished,
    quadratic_spec,
    wait_for,
)
from tests.e2e.conftest import WorkerProcess
from vramtune.common.plans import plan_in_words, rungs_of
from vramtune.service.client import Client

pytestmark = pytest.mark.browser
WAIT_MS = 60_000
MIB = 1024 * 1024
MEMORY_STUDY = "advice-memory"
BIASED_STUDY = "advice-biased"
NO_WORKER_STUDY = "advice-no-worker"
MISSING_TASK = "no-such-task"
UNPREDICTED = 8 * MIB


def memory_spec() -> dict[str, Any]:
    """Widths too large for the 64 MiB card (1024: routed) or for every card (4096: infeasible);
    pruned at the first report."""
    spec = quadratic_spec(MEMORY_STUDY, 8)
    spec["search_space"] |= {
        "batch_size": {"type": "categorical", "choices": [256]},
        "width": {"type": "categorical", "choices": [1024, 4096]},
    }
    # Every value is above -1: the threshold pruner prunes each trial at its first report.
    return spec | {"pruner": {"name": "threshold", "args": {"upper": -1.0}}}


def biased_spec() -> dict[str, Any]:
    """Narrow configurations that fit every card, each holding 8 MiB predict() does not see."""
    spec = quadratic_spec(BIASED_STUDY, 6)
    spec["search_space"] |= {
        "batch_size": {"type": "categorical", "choices": [32, 64]},
        "width": {"type": "categorical", "choices": [64]},
    }
    spec["task_config"] = spec["task_config"] | {"unpredicted_bytes": UNPREDICTED}
    return spec | {"pruner": {"name": "none"}}


@dataclass
class AdviceServer:
    """A server on one database whose studies produce each advice, and its admin token."""

    url: str
    admin: str
    database: str


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def advice_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AdviceServer]:
    """The studies run one after the other: the biased one last, so that the calibration it
    teaches the fleet does not change the plans of the memory study."""
    directory = tmp_path_factory.mktemp(f"advice-{request.param}")
    with ExitStack() as stack:
        server, tokens = auth_server(stack, request.param, directory)
        client = stack.enter_context(Client(server.url, token=tokens["admin"]))
        worker_token = ("--token", tokens["worker"])
        workers = [
            WorkerProcess(server.url, "64MiB", directory / "small-card.log", *worker_token),
            WorkerProcess(server.url, "256MiB", directory / "large-card.log", *worker_token),
        ]
        try:
            client.create_study(quadratic_spec(NO_WORKER_STUDY, 3) | {"task": MISSING_TASK})
            for spec in (memory_spec(), biased_spec()):
                client.create_study(spec)
                wait_for(partial(finished, client, spec["name"]), f"{spec['name']} to finish")
            yield AdviceServer(server.url, tokens["admin"], request.param)
        finally:
            for worker in workers:
                worker.stop()
                print(f"----- {worker.name}\n{worker.logs()[-4000:]}")


@pytest.fixture
def study_page(browser: Any, advice_server: AdviceServer) -> Iterator[Any]:
    """study_page(name) -> the study's page, signed in as admin, once its advice is drawn
    (in the session's one Chromium: tests/browser/conftest.py ``browser``)."""
    contexts: list[Any] = []

    def open_(name: str) -> Page:
        context = browser.new_context(viewport={"width": 1500, "height": 1000})
        contexts.append(context)
        token = json.dumps(advice_server.admin)
        context.add_init_script(f"sessionStorage.setItem('vramtune.token', {token})")
        page = Page(context.new_page())
        page.page.on("pageerror", lambda e: page.errors.append(f"uncaught: {e}"))
        page.page.goto(f"{advice_server.url}/studies/{quote(name, safe='')}")
        page.page.wait_for_function("() => document.body.dataset.advice", timeout=WAIT_MS)
        return page

    yield open_
    for context in contexts:
        context.close()


def advice_text(page: Page, kind: str) -> str:
    """The text of the one advice of this kind, once it is shown (exactly one must be)."""
    item = page.page.locator(f"#advice-list > li[data-advice='{kind}']")
    item.wait_for(state="visible", timeout=WAIT_MS)
    assert item.count() == 1
    return str(item.inner_text())


def advice_texts(page: Page, kind: str) -> list[str]:
    """The texts of every advice of this kind (one per card model, for calibration)."""
    items = page.page.locator(f"#advice-list > li[data-advice='{kind}']")
    items.first.wait_for(state="visible", timeout=WAIT_MS)
    return [str(text) for text in items.all_inner_texts()]


def test_infeasible_configurations_get_the_largest_card_and_what_would_fit(
    study_page: Any,
) -> None:
    page = study_page(MEMORY_STUDY)
    text = advice_text(page, "infeasible")
    assert "fit no card of the fleet" in text
    assert "The largest live card has 256 MiB" in text and "short" in text
    assert "add 'bf16' to memory_policy.resizes" in text  # the rung the policy leaves out
    assert "add a card of at least" in text and "MiB" in text
    assert re.search(r"\d{6,}", text) is None, text  # human units, never a raw byte count
    page.screenshot("advice-infeasible", full_page=False)  # for a person to look at


def test_a_routed_then_pruned_trial_shows_both_and_its_story(study_page: Any) -> None:
    page = study_page(MEMORY_STUDY)
    outcome = page.page.locator("td[data-col='outcome']", has_text="routed, pruned")
    row = page.page.locator("#trials tbody tr", has=outcome).first
    row.wait_for(state="visible", timeout=WAIT_MS)
    row.click()
    story = page.page.locator("#trial-timeline > li")
    story.last.wait_for(state="visible", timeout=WAIT_MS)
    kinds = [story.nth(i).get_attribute("data-event") for i in range(story.count())]
    assert kinds == ["leased", "handed_back", "routed", "resized", "pruned"], kinds
    assert "(64.0 MiB)" in story.nth(1).inner_text() and "(256 MiB)" in story.nth(2).inner_text()


def test_a_resized_trials_view_names_its_rungs(
    study_page: Any, advice_server: AdviceServer
) -> None:
    """The trial view says the plan's rungs in words, as vramtune.common.plans.plan_in_words says
    them."""
    page = study_page(MEMORY_STUDY)
    outcome = page.page.locator("td[data-col='outcome']", has_text="routed, pruned")
    row = page.page.locator("#trials tbody tr", has=outcome).first
    row.wait_for(state="visible", timeout=WAIT_MS)
    number = int(str(row.get_attribute("data-number")))
    row.click()
    shown = page.page.locator("#curve-details dt:text-is('plan') + dd")
    shown.wait_for(state="visible", timeout=WAIT_MS)
    with Client(advice_server.url, token=advice_server.admin) as client:
        page_of = client.trials(MEMORY_STUDY)
        (trial,) = [t for t in page_of.trials if t.number == number]
    assert trial.plan is not None and rungs_of(trial.plan), trial.plan  # it ran resized
    words = plan_in_words(trial.plan)
    assert re.search(r"micro-batch \d+ × \d+|checkpoint every block", str(words)), words
    assert shown.inner_text() == words
    assert page.errors == []


def test_a_biased_calibration_names_its_likely_cause(study_page: Any) -> None:
    page = study_page(BIASED_STUDY)
    texts = advice_texts(page, "calibration")  # per card model, or pooled when few runs
    for text in texts:
        assert "too low" in text and "under-predicted" in text
        # the unpredicted bytes, the same on small and large configurations
        assert "8.00 MiB on the smaller, 8.00 MiB on the larger" in text
        assert "evaluation" in text and "chunk" in text


def test_a_study_whose_task_no_worker_offers_says_so(study_page: Any) -> None:
    page = study_page(NO_WORKER_STUDY)
    text = advice_text(page, "no_worker")
    assert f"No live worker offers task '{MISSING_TASK}'" in text
    note = page.page.locator("#trials-note")
    note.wait_for(state="visible", timeout=WAIT_MS)
    assert f"no live worker offers task '{MISSING_TASK}'" in note.inner_text()


def test_a_study_that_needs_no_advice_shows_no_panel(study_page: Any) -> None:
    page = study_page(BIASED_STUDY)
    assert page.page.locator("#advice-list > li[data-advice='infeasible']").count() == 0
    assert page.page.locator("#advice-list > li[data-advice='no_worker']").count() == 0
