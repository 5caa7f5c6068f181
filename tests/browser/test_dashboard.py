"""The dashboard in headless Chromium against a live server whose study real CPU workers ran."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest

from tests.browser.conftest import (
    METRIC,
    MO_STUDY,
    N_TRIALS,
    STUDY,
    XSS_PARAM,
    XSS_PARAM_STUDY,
    XSS_STUDY,
    Live,
    OpenPage,
    Page,
    quadratic_spec,
)
from tests.e2e.conftest import tell_non_finite

pytestmark = pytest.mark.browser

WAIT_MS = 60_000
DASH = "\u2013"  # an en dash, as in the pager's "1-25 of 30"
INF, MINUS_INF = "\u221e", "\u2212\u221e"  # how the pages write +inf and -inf
PLOTS = ("history", "memory", "calibration", "regions", "curve")


def study_url(live: Live, name: str) -> str:
    """The study page's URL, the name escaped as the studies page links it."""
    from urllib.parse import quote

    return f"{live.url}/studies/{quote(name, safe='')}"


def wait_rendered(page: Page) -> None:
    """Until the study page has drawn everything but the importances once."""
    wait_until(page, "() => document.body.dataset.rendered")


def wait_until(page: Page, js: str) -> None:
    """Until a JS predicate holds in the page."""
    page.page.wait_for_function(js, timeout=WAIT_MS)


def wait_text(page: Page, selector: str, check: str) -> None:
    """Until the text of the element ``selector`` finds passes ``check`` (JS after the text)."""
    wait_until(page, f"() => document.querySelector({json.dumps(selector)}).textContent{check}")


def wait_importances(page: Page, objective: int = 0) -> None:
    """Until the study page has drawn the importances of ``objective``."""
    wait_until(page, f"() => (document.body.dataset.importances || '').endsWith('/{objective}')")


def text(page: Page, selector: str) -> str:
    """The text of the first element the selector finds."""
    return page.page.locator(selector).first.inner_text()


def points(page: Page, plot: str) -> int:
    """Points (markers, line vertices, bars) drawn in one of the study page's plots."""
    return int(page.page.get_attribute(f"#plot-{plot}", "data-points") or 0)


def column(page: Page, key: str) -> list[str]:
    """The text of one column of the trial table, top to bottom."""
    return [
        t.strip()
        for t in page.page.locator(f"#trials tbody td[data-col='{key}']").all_inner_texts()
    ]


def wait_table(page: Page, check: str) -> None:
    """Until a JS predicate over the trial table's rows holds."""
    rows = "[...document.querySelectorAll('#trials tbody tr')]"
    js = f"() => {{ const rows = {rows}; return {check}; }}"
    wait_until(page, js)


def test_studies_page_lists_studies_with_their_counts(live: Live, open_page: OpenPage) -> None:
    page = open_page(f"{live.url}/")
    row = page.page.locator(f"tr[data-study='{STUDY}']")
    row.wait_for(timeout=WAIT_MS)
    text = row.inner_text()
    assert "done" in text
    assert f"{N_TRIALS} / {N_TRIALS}" in text
    assert "quadratic" in text
    memory = row.locator("td[data-col='memory']")
    assert "infeasible" in memory.inner_text()  # width 4096 fits no card of the fleet
    assert "resized" in memory.inner_text() or "routed" in memory.inner_text()
    page.screenshot("dashboard-studies")
    assert page.errors == []


def test_study_page_draws_every_plot_with_points(live: Live, open_page: OpenPage) -> None:
    page = open_page(study_url(live, STUDY))
    wait_rendered(page)
    for plot in PLOTS:
        assert points(page, plot) > 0, f"the {plot} plot has no points"
    wait_importances(page)
    assert points(page, "importances") >= 2
    # one objective: no objective selector, no Pareto front of objectives
    assert not page.page.locator("#objective-bar").is_visible()
    assert not page.page.locator("#card-pareto").is_visible()
    legend = " ".join(page.page.locator("#plot-regions .legend-item").all_inner_texts())
    assert "infeasible" in legend, legend  # width 4096 fits no card of the fleet
    assert "as asked" in legend, legend
    assert page.page.locator("#calibration-stats tbody tr").count() >= 1
    headers = page.page.locator("#calibration-stats th").all_inner_texts()
    assert {"samples", "median bias", "under-predicted"} <= set(headers), headers
    bias = text(page, "#calibration-stats td[data-col='median bias']")
    assert re.fullmatch(r"[+-]?\d+\.\d %", bias), bias  # signed when not zero
    assert "Under-predicted: runs that used more memory" in text(page, "#calibration-note")
    page.screenshot("dashboard-study")
    assert page.errors == []


def test_axes_are_named_with_the_metric(live: Live, open_page: OpenPage) -> None:
    page = open_page(study_url(live, STUDY))
    wait_rendered(page)
    assert text(page, "#plot-history .axis-y") == METRIC
    assert text(page, "#plot-memory .axis-y") == METRIC
    assert text(page, "#memory-title") == f"{METRIC} vs peak memory"
    assert page.errors == []


def memory_answer(peaks_mib: list[int]) -> dict[str, Any]:
    """A /memory answer with these measured peaks (what the page is given instead of STUDY's)."""
    n = len(peaks_mib)
    return {
        "objective": 0, "direction": "minimize", "total": n, "numbers": list(range(n)),
        "values": [float(i) for i in range(n)], "measured_bytes": [p * 2**20 for p in peaks_mib],
        "card_models": ["sim"] * n, "outcomes": ["as_asked"] * n, "front_numbers": [0],
        "front_values": [0.0], "front_bytes": [peaks_mib[0] * 2**20], "downsampled": False,
    }  # fmt: skip


@pytest.mark.parametrize(("peaks_mib", "log"), [([2, 40, 2048], True), ([200, 400, 900], False)])
def test_memory_axes_are_logarithmic_when_peaks_span_decades(
    live: Live, open_page: OpenPage, peaks_mib: list[int], log: bool
) -> None:
    context = open_page(f"{live.url}/fleet").page.context  # a context to route, then navigate
    answer = memory_answer(peaks_mib)
    context.route(re.compile(r"/memory\?"), lambda route: route.fulfill(json=answer))
    page = Page(context.new_page())
    page.page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.page.goto(study_url(live, STUDY))
    wait_rendered(page)
    assert points(page, "memory") >= len(peaks_mib)
    assert text(page, "#plot-memory .axis-x").endswith(", log)") is log
    assert page.errors == []


def test_importances_from_few_trials_carry_a_caveat(live: Live, open_page: OpenPage) -> None:
    page = open_page(study_url(live, STUDY))
    wait_importances(page)
    assert text(page, "#importances-caveat") == ""  # 15 completed trials: no caveat
    context = page.page.context
    few = {
        "objective": 0, "evaluator": "PedAnovaImportanceEvaluator", "n_complete": 4,
        "n_used": 4, "importances": [{"name": "x", "importance": 1.0}],
        "caveat": "from 4 completed trials only", "computed_at": "2030-01-01T00:00:00Z",
    }  # fmt: skip
    context.route(re.compile(r"/importances\?"), lambda route: route.fulfill(json=few))
    page.page.reload()
    wait_importances(page)
    assert text(page, "#importances-caveat") == "Caveat: from 4 completed trials only."
    assert page.page.locator("#importances-caveat").is_visible()
    assert page.errors == []


def test_the_page_opens_before_its_importances_arrive(live: Live, open_page: OpenPage) -> None:
    held: list[Any] = []
    context = open_page(f"{live.url}/fleet").page.context  # a context to route, then navigate
    context.route(re.compile(r"/importances\?"), lambda route: held.append(route))  # held
    page = Page(context.new_page())
    page.page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.page.goto(study_url(live, STUDY))
    wait_rendered(page)  # history, memory plots and the trial table, without importances
    assert points(page, "history") > 0 and points(page, "memory") > 0
    assert page.page.locator("#trials tbody tr").count() > 0
    wait_text(page, "#card-importances .empty", " === 'Computing importances…'")
    assert held, "the page never asked for importances"
    for route in held:
        route.continue_()
    wait_importances(page)
    assert points(page, "importances") >= 2
    assert text(page, "#card-importances .empty") == ""
    assert page.errors == []


def test_a_multi_objective_study_has_an_objective_selector_and_a_front(
    live: Live, open_page: OpenPage
) -> None:
    page = open_page(study_url(live, MO_STUDY))
    wait_rendered(page)
    assert page.page.locator("#objective option").all_inner_texts() == [
        "objective 0 (minimize)",
        "objective 1 (maximize)",
    ]
    assert points(page, "pareto") > 0
    assert text(page, "#plot-pareto .axis-x") == "objective 0 (minimize)"
    assert text(page, "#plot-pareto .axis-y") == "objective 1 (maximize)"
    front = len(live.client.pareto_front(MO_STUDY).trials)  # the service's own front
    assert f"{front} on the front" in text(page, "#pareto-hint")
    assert text(page, "#plot-history .axis-y") == "objective 0"
    wait_importances(page, 0)
    page.screenshot("dashboard-study-multi-objective")
    page.screenshot("dashboard-study-multi-objective-window", full_page=False)  # for the README

    page.page.select_option("#objective", "1")
    for plot in ("history", "memory"):
        wait_text(page, f"#plot-{plot} .axis-y", " === 'objective 1'")
        assert points(page, plot) > 0
    wait_importances(page, 1)
    assert text(page, "#importances-hint").startswith("objective 1")
    assert "maximize objective 1" in text(page, "#history-hint")

    page.page.select_option("#pareto-x", "1")  # both axes on one objective: nothing to front
    wait_text(page, "#card-pareto .empty", ".includes('two different')")
    page.page.select_option("#pareto-y", "0")
    wait_text(page, "#plot-pareto .axis-x", ".startsWith('objective 1')")
    assert points(page, "pareto") > 0

    page.page.click("#trials th[data-sort='value:1']")  # objective 1, ascending
    wait_table(page, "rows.length > 0")
    wait_until(
        page,
        "() => document.querySelector(\"#trials th[data-sort='value:1']\")"
        ".classList.contains('sorted-asc')",
    )
    assert page.errors == []


def test_trial_table_sorts_filters_and_pages(live: Live, open_page: OpenPage) -> None:
    page = open_page(study_url(live, STUDY))
    wait_rendered(page)
    page.page.select_option("#page-size", "25")
    wait_table(page, "rows.length === 25")
    info = page.page.locator("#page-info")
    assert info.inner_text().startswith(f"1{DASH}25 of ")
    assert column(page, "number")[0] == str(N_TRIALS - 1)  # newest first
    page.page.click("#next-page")
    wait_text(page, "#page-info", f".startsWith('26{DASH}')")
    assert column(page, "number")[0] == str(N_TRIALS - 26)
    page.page.click("#first-page")
    wait_text(page, "#page-info", f".startsWith('1{DASH}25 ')")
    page.page.click("#last-page")
    wait_text(page, "#page-info", f" === '26{DASH}{N_TRIALS} of {N_TRIALS}'")
    assert page.page.locator("#next-page").is_disabled()
    page.page.click("#trials th[data-sort='number']")  # back to the first page, oldest first
    wait_table(page, "rows.length === 25 && rows[0].querySelector('td').textContent === '0'")
    page.page.check("#state-filter input[value='COMPLETE']")
    wait_table(page, "rows.every(r => r.querySelector('.badge').textContent === 'COMPLETE')")
    outcomes = page.page.locator("#outcome-filter option").all_inner_texts()
    chosen = next(o for o in outcomes if o not in ("all", "none"))
    page.page.select_option("#outcome-filter", label=chosen)
    wait_table(
        page,
        f"rows.every(r => r.querySelector(\"td[data-col='outcome']\").textContent === '{chosen}')",
    )
    workers = page.page.locator("#worker-filter option").all_inner_texts()
    page.page.select_option("#outcome-filter", "")
    page.page.select_option("#worker-filter", "large-card")
    assert "large-card" in workers
    wait_table(
        page,
        "rows.every(r => r.querySelector(\"td[data-col='worker']\").textContent === 'large-card')",
    )
    assert page.errors == []


def test_region_map_and_curve_follow_the_users_choice(live: Live, open_page: OpenPage) -> None:
    page = open_page(study_url(live, STUDY))
    wait_rendered(page)
    page.page.select_option("#region-x", "x")
    page.page.select_option("#region-y", "y")
    wait_text(page, "#plot-regions .axis-x", " === 'x'")
    wait_text(page, "#plot-regions .axis-y", " === 'y'")
    assert points(page, "regions") > 0
    page.page.click("#trials tbody tr[data-number='3']")
    wait_text(page, "#curve-title", " === 'Trial #3'")
    assert page.errors == []


def test_the_region_map_names_the_rungs_resized_trials_used(
    live: Live, open_page: OpenPage
) -> None:
    page = open_page(study_url(live, STUDY))
    wait_rendered(page)
    legend = page.page.locator("#plot-regions .legend-item").all_inner_texts()
    resized = [name for name in legend if name.startswith("resized")]
    assert resized, legend  # the study resizes its wide batches on the 64 MiB card
    rungs = ("micro-batches", "checkpointing")  # what its memory_policy allows
    for name in resized:
        assert re.fullmatch(r"resized: [a-z -]+( \+ [a-z -]+)* \(\d+\)", name), name
        assert all(rung in rungs for rung in name[len("resized: ") :].split(" (")[0].split(" + "))
    assert page.errors == []


def test_hostile_names_render_as_text(live: Live, open_page: OpenPage) -> None:
    page = open_page(f"{live.url}/")
    page.page.locator("td.name a").first.wait_for(timeout=WAIT_MS)
    assert XSS_STUDY in page.page.locator("td.name a").all_inner_texts()
    assert_no_script_ran(page)

    page = open_page(study_url(live, XSS_STUDY))
    wait_rendered(page)
    assert page.page.locator("#study-name").inner_text() == XSS_STUDY
    assert "<b>bold</b>" in page.page.locator("#trials thead th").all_inner_texts()
    assert page.page.locator("#plot-regions .axis-x").text_content() == "<b>bold</b>"
    assert_no_script_ran(page)

    page = open_page(study_url(live, XSS_PARAM_STUDY))
    wait_rendered(page)
    assert XSS_PARAM in page.page.locator("#trials thead th").all_inner_texts()
    assert page.page.locator("main img").count() == 0
    assert_no_script_ran(page)


def test_values_that_are_not_finite_show_as_symbols(live: Live, open_page: OpenPage) -> None:
    name = f"dash-non-finite-{uuid.uuid4().hex[:6]}"
    space = {"x": {"type": "float", "low": 0.0, "high": 1.0}}
    live.client.create_study(quadratic_spec(name, 4, task="told-by-optuna", search_space=space))
    tell_non_finite(live.database_url, name)  # +inf, -inf, NaN (a FAIL), 1.5
    page = open_page(study_url(live, name))
    wait_rendered(page)
    page.page.click("#trials th[data-sort='number']")  # oldest first
    wait_table(page, "rows.length === 4 && rows[0].querySelector('td').textContent === '0'")
    assert column(page, "value") == [INF, MINUS_INF, DASH, "1.5"]
    assert text(page, "#study-summary").count(MINUS_INF) == 1  # the best value
    page.page.click("#trials tbody tr[data-number='0']")
    wait_text(page, "#curve-title", " === 'Trial #0'")
    assert text(page, "#curve-details dt:text-is('value') + dd") == INF
    assert points(page, "curve") == 1  # 0.5: NaN and the infinities have no place on an axis
    shown = page.page.evaluate("() => ['Infinity', '-Infinity', 'NaN', 2].map(VT.value)")
    assert shown == [INF, MINUS_INF, "NaN", "2"]
    # Trial numbers are whole: a history of few trials ticks no fractions between them.
    ticks = (page.page.get_attribute("#plot-history", "data-x-ticks") or "").split()
    assert ticks and all(tick.isdigit() for tick in ticks), ticks
    page = open_page(f"{live.url}/")
    row = page.page.locator(f"tr[data-study='{name}']")
    row.wait_for(timeout=WAIT_MS)
    assert MINUS_INF in row.inner_text()
    assert page.errors == []


def assert_no_script_ran(page: Page) -> None:
    """No injected script ran, no dialog opened, no error was logged."""
    page.page.wait_for_timeout(200)
    assert page.page.evaluate("() => window.__xss") is None
    assert page.dialogs == []
    assert page.errors == []


def test_fleet_page_shows_workers_their_cards_and_trials(live: Live, open_page: OpenPage) -> None:
    page = open_page(f"{live.url}/fleet")
    for name in ("small-card", "large-card"):
        row = page.page.locator(f"tr[data-worker='{name}'][data-state='live']")
        row.wait_for(timeout=WAIT_MS)  # a heartbeat late on a busy machine passes
        assert "MiB" in row.inner_text()
    cells = page.page.locator("#workers tbody td[data-col='trials']").all_inner_texts()
    run_done = [[int(n.replace(",", "")) for n in cell.split(" / ")] for cell in cells]
    assert all(run >= done for run, done in run_done), cells  # every completed trial was run
    assert sum(done for _, done in run_done) >= N_TRIALS // 2
    assert "Live workers" in page.page.locator("#fleet-summary").inner_text()
    page.screenshot("dashboard-fleet")
    assert page.errors == []


def test_a_stopped_worker_is_greyed_out(live: Live, open_page: OpenPage) -> None:
    import httpx

    card = {"model": "sim-gone", "total_bytes": 2**30, "free_bytes": 2**30, "simulated": True}
    worker = {"name": "gone-worker", "device": "cpu", "card": card, "tasks": ["nothing"]}
    headers = {"Authorization": f"Bearer {live.tokens['worker']}"}
    with httpx.Client(base_url=f"{live.url}/api/v1", headers=headers) as http:
        worker_id = http.post("/workers", json=worker).json()["worker_id"]
        assert http.post(f"/workers/{worker_id}/stop").status_code == 204
    page = open_page(f"{live.url}/fleet")
    row = page.page.locator("tr[data-worker='gone-worker'][data-state='stopped']")
    row.wait_for(timeout=WAIT_MS)
    assert "stopped" in (row.get_attribute("class") or "")
    opacity = row.locator("td").first.evaluate("td => getComputedStyle(td).opacity")
    assert float(opacity) < 1
    live_row = page.page.locator("tr[data-worker='small-card']")
    assert live_row.locator("td").first.evaluate("td => getComputedStyle(td).opacity") == "1"
    assert page.errors == []


def test_the_fleet_page_pages_workers_live_first(live: Live, open_page: OpenPage) -> None:
    """Past a page of workers (100), the page shows 100 rows, live first, and Next shows the
    rest; the summary still counts every worker."""
    import httpx

    card = {"model": "sim-paged", "total_bytes": 2**30, "free_bytes": 2**30, "simulated": True}
    worker = {"name": "paged-worker", "device": "cpu", "card": card, "tasks": ["nothing"]}
    headers = {"Authorization": f"Bearer {live.tokens['worker']}"}
    with httpx.Client(base_url=f"{live.url}/api/v1", headers=headers, timeout=30) as http:
        for _ in range(101):  # stopped: they sort after the live workers
            worker_id = http.post("/workers", json=worker).json()["worker_id"]
            assert http.post(f"/workers/{worker_id}/stop").status_code == 204
    page = open_page(f"{live.url}/fleet")
    info = page.page.locator("#page-info")
    shows = "n => document.querySelector('#page-info').textContent.startsWith(`workers ${n}`)"
    page.page.wait_for_function(shows, arg=1)
    first, last, total = (int(n) for n in re.findall(r"\d+", info.inner_text().replace(",", "")))
    assert (first, last) == (1, 100) and total >= 103, info.inner_text()
    rows = page.page.locator("#workers tbody tr")
    assert rows.count() == 100
    states = rows.evaluate_all("rows => rows.map(r => r.dataset.state)")
    assert states[0] == "live" and states[-1] == "stopped", states
    assert page.page.locator("#prev-page").is_disabled()
    page.page.locator("#next-page").click()
    page.page.wait_for_function(shows, arg=101)
    assert rows.count() == total - 100
    assert set(rows.evaluate_all("rows => rows.map(r => r.dataset.state)")) == {"stopped"}
    assert page.page.locator("#next-page").is_disabled()
    assert not page.page.locator("#prev-page").is_disabled()
    summary = page.page.locator("#fleet-summary").inner_text().replace(",", "")
    stopped = re.search(r"(\d+) stopped", summary)
    assert stopped is not None and int(stopped.group(1)) >= 101, summary  # every page counted
    assert page.errors == []


def test_pages_update_without_a_reload(live: Live, open_page: OpenPage) -> None:
    page = open_page(f"{live.url}/")
    page.page.locator(f"tr[data-study='{STUDY}']").wait_for(timeout=WAIT_MS)
    name = f"dash-live-{uuid.uuid4().hex[:6]}"
    live.client.create_study(quadratic_spec(name, 4))
    row = page.page.locator(f"tr[data-study='{name}']")
    row.wait_for(timeout=WAIT_MS)  # appears on a poll: the page is not reloaded
    wait_text(page, f"tr[data-study='{name}']", ".includes('4 / 4')")
    assert page.errors == []


def test_study_page_follows_a_running_study(live: Live, open_page: OpenPage) -> None:
    name = f"dash-live-study-{uuid.uuid4().hex[:6]}"
    live.client.create_study(quadratic_spec(name, 6))
    live.client.pause(name)  # the page first sees it stopped, before most of its trials ran
    page = open_page(study_url(live, name))
    wait_rendered(page)
    page.page.evaluate("() => { window.__samePage = true; }")
    live.client.resume(name)
    wait_text(page, "#study-state", " === 'done'")
    wait_table(page, "rows.length === 6")
    wait_text(page, "#page-info", f" === '1{DASH}6 of 6'")
    assert page.page.evaluate("() => window.__samePage") is True  # updated, not reloaded
    assert page.errors == []


# ---------------------------------------------------------------- auth


def sign_in(page: Page, token: str) -> None:
    """Fill the login box the page shows."""
    page.page.locator("#login input[name='token']").fill(token)
    page.page.locator("#login button[type='submit']").click()


def test_login_and_read_only_viewers_see_no_write_buttons(live: Live, open_page: OpenPage) -> None:
    page = open_page(study_url(live, STUDY), token=None)
    page.page.locator("#login").wait_for(timeout=WAIT_MS)  # 401: the page asks for a token
    wait_text(page, "#live", " === 'sign in to see updates'")  # not "update failed"
    sign_in(page, live.tokens["read"])
    wait_rendered(page)
    wait_text(page, "#live", ".startsWith('updated ')")
    assert points(page, "history") > 0
    assert page.page.locator("[data-action]").count() == 0
    assert "read" in page.page.locator("#auth").inner_text()

    page.page.goto(f"{live.url}/")  # the token stays for the tab (sessionStorage)
    page.page.locator(f"tr[data-study='{STUDY}']").wait_for(timeout=WAIT_MS)
    assert page.page.locator("[data-action]").count() == 0

    admin = open_page(study_url(live, STUDY), token=None)
    admin.page.locator("#login").wait_for(timeout=WAIT_MS)
    sign_in(admin, live.tokens["admin"])
    admin.page.locator("[data-action='delete']").wait_for(timeout=WAIT_MS)
    refused = [
        e for e in page.errors + admin.errors if "401" not in e
    ]  # the first, signed-out calls
    assert refused == []


def test_a_worker_token_cannot_read_the_dashboard(live: Live, open_page: OpenPage) -> None:
    page = open_page(f"{live.url}/", token="worker")
    notice = page.page.locator("#notice")
    notice.wait_for(timeout=WAIT_MS)  # 403: the page says which scope is missing
    assert "'read'" in notice.inner_text()
    assert page.page.locator("tr[data-study]").count() == 0
