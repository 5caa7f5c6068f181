"""A node worker's cards on the fleet page and a distributed trial's ranks in the trial view
(issue 31), in headless Chromium, on SQLite and PostgreSQL.

The node speaks the worker protocol over HTTP (registration with 4 cards, lease, start with a
2-rank plan, complete with each rank's peak), as `vramtune worker --ranks 4` does; the real rank
processes are tested end to end in tests/e2e/test_multigpu.py. Here what is checked is what the
server keeps of them and what the pages show.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.browser.conftest import Page, auth_server, quadratic_spec

pytestmark = pytest.mark.browser
WAIT_MS = 60_000
MIB = 2**20
STUDY = "node-views"
CARD = {"model": "Sim 12M", "total_bytes": 12 * MIB, "free_bytes": 12 * MIB}
PLAN = {"world_size": 2, "strategy": "ddp", "reason": "2 ranks, ddp"}
PREDICTED = 10 * MIB
RANK_PEAKS = [10 * MIB, 9 * MIB + MIB // 2]


@dataclass
class Node:
    """A server on one database with a 4-card node holding one 2-rank trial, started."""

    url: str
    admin: str
    http: httpx.Client  # as the node worker (a worker token)
    assignment: dict[str, Any]

    def complete(self) -> None:
        """The trial ends with each rank's measured peak."""
        measured = {"peak_allocated_bytes": max(RANK_PEAKS), "rank_peak_bytes": RANK_PEAKS}
        body = {
            "lease": self.assignment["lease"],
            "values": [0.5],
            "plan": PLAN,
            "prediction": {"peak_allocated_bytes": PREDICTED, "peak_reserved_bytes": PREDICTED},
            "measured": measured,
            "duration_s": 1.0,
        }
        response = self.http.post(f"/trials/{self.assignment['trial_id']}/complete", json=body)
        assert response.status_code == 200, response.text


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def node(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Node]:
    directory = tmp_path_factory.mktemp(f"node-{request.param}")
    with ExitStack() as stack:
        server, tokens = auth_server(stack, request.param, directory)
        admin = {"Authorization": f"Bearer {tokens['admin']}"}
        worker = {"Authorization": f"Bearer {tokens['worker']}"}
        api = f"{server.url}/api/v1"
        http = stack.enter_context(httpx.Client(base_url=api, headers=worker, timeout=60))
        spec = quadratic_spec(STUDY, 1, distributed={"strategies": ["ddp"], "max_world_size": 4})
        created = httpx.post(f"{api}/studies", json=spec, headers=admin, timeout=60)
        assert created.status_code == 201, created.text
        body = {"name": "node-a", "device": "cpu", "card": CARD, "tasks": ["quadratic"]}
        registered = http.post("/workers", json={**body, "cards": [CARD] * 4})
        assert registered.status_code == 201, registered.text
        worker_id = registered.json()["worker_id"]
        leased = http.post(f"/workers/{worker_id}/next", json={"free_bytes": CARD["free_bytes"]})
        assert leased.status_code == 200, leased.text
        assignment = leased.json()
        started = http.post(
            f"/trials/{assignment['trial_id']}/start",
            json={"lease": assignment["lease"], "plan": PLAN},
        )
        assert started.status_code == 200, started.text
        yield Node(server.url, tokens["admin"], http, assignment)


def open_as_admin(browser: Any, node: Node, path: str, ready: str) -> Page:
    """The page at `path`, signed in as admin, once `ready` (a JS condition) holds."""
    context = browser.new_context(viewport={"width": 1500, "height": 1000})
    context.add_init_script(f"sessionStorage.setItem('vramtune.token', {json.dumps(node.admin)})")
    page = Page(context.new_page())
    page.page.on("pageerror", lambda e: page.errors.append(f"uncaught: {e}"))
    page.page.goto(f"{node.url}{path}")
    page.page.wait_for_function(ready, timeout=WAIT_MS)
    return page


def test_the_fleet_page_shows_a_nodes_cards_busy_and_free_then_the_trial_its_ranks(
    browser: Any, node: Node
) -> None:
    fleet = open_as_admin(
        browser, node, "/fleet", "() => document.querySelector('#workers tbody tr')"
    )
    cards = fleet.page.locator("tr[data-worker='node-a'] td[data-col='cards']")
    assert cards.inner_text().strip() == "2 of 4 busy"
    assert cards.locator(".cardsq.busy").count() == 2 and cards.locator(".cardsq").count() == 4
    assert "· 2 cards" in fleet.page.locator("tr[data-worker='node-a']").inner_text()
    fleet.screenshot("fleet-node-cards", full_page=False)

    node.complete()
    study = open_as_admin(
        browser,
        node,
        f"/studies/{quote(STUDY, safe='')}",
        "() => document.querySelector('#trials tbody tr')",
    )
    row = study.page.locator("#trials tbody tr").first
    assert "2 ranks, ddp" in row.inner_text()
    row.click()
    details = study.page.locator("#curve-details")
    details.get_by_text("per rank predicted / measured").wait_for(timeout=WAIT_MS)
    text = details.inner_text()
    assert "rank 0: 10.0 MiB / 10.0 MiB" in text and "rank 1: 10.0 MiB / 9.5" in text, text
    assert fleet.errors == [] and study.errors == []
    after = open_as_admin(
        browser, node, "/fleet", "() => document.querySelector('#workers tbody tr')"
    )
    idle = after.page.locator("tr[data-worker='node-a'] td[data-col='cards']")
    assert idle.inner_text().strip() == "0 of 4 busy"
