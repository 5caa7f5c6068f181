"""Every endpoint of the app x every kind of caller -> the expected 2xx/4xx, 401 or 403.

The endpoints are enumerated from the app itself, so a new endpoint without a line in
service.auth.tokens.POLICY fails test_every_endpoint_has_a_policy (and gets admin-only meanwhile).
"""

from __future__ import annotations

import re

import pytest
from security_fixtures import OTHER, OWN, TOKEN_KINDS, Secured, study_spec
from sqlalchemy import select

from vramtune.service.app import create_app
from vramtune.service.auth import tokens as auth
from vramtune.service.auth.guard import endpoint_keys
from vramtune.service.db.tables import StudyRow
from vramtune.service.settings import Settings

ENDPOINTS = endpoint_keys(create_app(Settings(database_url="sqlite://")))  # connects nothing
CALLERS = ["none", "bad", "read", "submit", "worker", "admin", "limited-own", "limited-other"]
PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


def expected(rule: auth.Rule, caller: str) -> int | None:
    """401, 403, or None for "neither" (2xx, or a 4xx about the request itself)."""
    if rule.public:
        return None
    if caller in ("none", "bad"):
        return 401
    kind = caller.split("-")[0]
    scopes, studies = TOKEN_KINDS[kind]
    limited_to = None if studies is None else frozenset(studies)
    principal = auth.Principal("t", frozenset(scopes), limited_to)
    if auth.missing_scope(principal, rule) is not None:
        return 403
    if caller == "limited-other" and rule.studies == "path":
        return 403
    if kind == "limited" and rule.studies == "many":
        return 403
    return None


def concrete(template: str, secured: Secured, study: str) -> str:
    """The template with every parameter filled in for the given study."""
    secured.ensure_studies()

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in ("name", "study", "study_name"):
            return study
        if name == "study_id":
            with secured.app.state.vt.sessions() as session:
                return str(session.scalar(select(StudyRow.study_id).where(StudyRow.name == study)))
        if name == "trial_id":
            return str(secured.trials[study])
        if name == "token_id":  # a throwaway token, so that revoking it harms no other case
            return str(secured.add_token(["read"])[0])
        if name == "path":
            return "index.html"
        return "1"

    return PARAM.sub(value, template)


def test_every_endpoint_has_a_policy() -> None:
    """No endpoint falls through to the fail-closed default; no policy names a ghost route."""
    missing = [key for key in ENDPOINTS if key not in auth.POLICY]
    assert missing == [], f"add these endpoints to vramtune.service.auth.tokens.POLICY: {missing}"
    ghosts = [key for key in auth.POLICY if key not in ENDPOINTS]
    assert ghosts == [], f"POLICY lists endpoints the app does not have: {ghosts}"


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize(("method", "template"), ENDPOINTS, ids=[f"{m} {p}" for m, p in ENDPOINTS])
def test_scope_matrix(secured: Secured, method: str, template: str, caller: str) -> None:
    """The guard answers exactly what the policy says, and no call is a 5xx."""
    rule = auth.rule_for(method, template)
    study = OTHER if caller == "limited-other" else OWN
    path = concrete(template, secured, study)
    response = secured.client.request(method, path, headers=secured.headers(caller.split("-")[0]))
    want = expected(rule, caller)
    assert response.status_code < 500, response.text
    if want is None:
        assert response.status_code not in (401, 403), response.text
        return
    assert response.status_code == want, response.text
    detail = response.json()["detail"]
    if want == 401:
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    elif "limited" in detail:
        assert caller.startswith("limited")
    else:  # the body says which scope is needed
        assert any(f"'{scope}'" in detail for scope in rule.scopes), detail


def test_worker_token_cannot_submit_or_delete(secured: Secured) -> None:
    """The issue's examples, spelled out."""
    headers = secured.headers("worker")
    created = secured.client.post("/api/v1/studies", json=study_spec("by-worker"), headers=headers)
    assert created.status_code == 403 and "'submit'" in created.json()["detail"]
    deleted = secured.client.delete(f"/api/v1/studies/{OWN}", headers=headers)
    assert deleted.status_code == 403 and "'admin'" in deleted.json()["detail"]


def test_read_token_cannot_write(secured: Secured) -> None:
    """Every endpoint but GET ones refuses a read token (except the public ones)."""
    writes = [(m, p) for m, p in ENDPOINTS if m != "GET" and not auth.rule_for(m, p).public]
    assert writes, "the app has no write endpoint?"
    for method, template in writes:
        path = concrete(template, secured, OWN)
        response = secured.client.request(method, path, headers=secured.headers("read"))
        assert response.status_code == 403, (method, template, response.text)


def test_limited_token_cannot_touch_another_study(secured: Secured) -> None:
    """A token limited to OWN reads and steers OWN but not OTHER."""
    headers = secured.headers("limited")
    assert secured.client.get(f"/api/v1/studies/{OWN}", headers=headers).status_code == 200
    for path in (f"/api/v1/studies/{OTHER}", f"/api/v1/studies/{OTHER}/trials"):
        assert secured.client.get(path, headers=headers).status_code == 403
    paused = secured.client.post(f"/api/v1/studies/{OTHER}/pause", headers=headers)
    assert paused.status_code == 403
    listed = secured.client.get("/api/v1/studies", headers=headers)
    assert listed.status_code == 403, "listing would show other studies"


def test_policy_says_what_the_issue_says() -> None:
    """Tokens are admin's; deletes are admin's; the worker protocol is the workers'."""
    for method, path in ENDPOINTS:
        rule = auth.rule_for(method, path)
        if path.startswith("/api/v1/tokens") or method == "DELETE":
            assert rule.scopes == {"admin"}, (method, path)
        if path.startswith("/api/v1/trials/") or (method == "POST" and "/workers" in path):
            assert rule.scopes == {"worker"}, (method, path)
        if method != "GET":
            assert "read" not in rule.scopes and not rule.public, (method, path)


def register_worker(secured: Secured, kind: str) -> int:
    """A simulated-card worker registered with a token of this kind."""
    card = {"model": "sim", "total_bytes": 2**34, "free_bytes": 2**34, "simulated": True}
    body = {"name": f"w-{kind}", "device": "cpu", "card": card, "tasks": ["quadratic"]}
    response = secured.client.post("/api/v1/workers", json=body, headers=secured.headers(kind))
    assert response.status_code == 201, response.text
    return int(response.json()["worker_id"])


def test_limited_worker_is_offered_only_its_studies(secured: Secured) -> None:
    """With OWN paused, a worker token limited to OWN gets no work although OTHER has some."""
    admin = secured.headers("admin")
    secured.ensure_studies()
    assert secured.client.post(f"/api/v1/studies/{OWN}/pause", headers=admin).status_code == 200
    try:
        ask = {"free_bytes": 2**33}
        limited = register_worker(secured, "limited")
        offered = secured.client.post(
            f"/api/v1/workers/{limited}/next", json=ask, headers=secured.headers("limited")
        )
        assert offered.status_code == 204, f"offered a trial of {offered.json()['study']}"
        anyone = register_worker(secured, "worker")
        other = secured.client.post(
            f"/api/v1/workers/{anyone}/next", json=ask, headers=secured.headers("worker")
        )
        assert other.status_code == 200 and other.json()["study"] == OTHER
    finally:
        secured.client.post(f"/api/v1/studies/{OWN}/resume", headers=admin)
