"""Tokens: issued once in clear, stored only as SHA-256 hashes, accepted only as bearer headers."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from security_fixtures import BAD_TOKEN, OWN, Live, Secured, first_token, migrated_sqlite
from sqlalchemy import create_engine, text

from vramtune.service.app import create_app
from vramtune.service.auth import tokens as auth
from vramtune.service.cli.parser import main
from vramtune.service.cli.tokens import ADMIN_TOKEN_ENV, print_first_admin_token
from vramtune.service.db.engine import make_engine
from vramtune.service.settings import Settings
from vramtune.service.state import utcnow
from vramtune.service.testing import IN_PROCESS_HOSTS

REPO = Path(__file__).resolve().parents[2]


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The same CLI in-process (vramtune.service.cli.parser.main): exit code, stdout, stderr."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def whoami(url: str, token: str) -> httpx.Response:
    """whoami against a live server."""
    return httpx.get(f"{url}/api/v1/auth/whoami", headers={"Authorization": f"Bearer {token}"})


def test_tokens_are_stored_only_as_hashes(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    """db upgrade printed the first admin token once; CLI and REST tokens work; none is stored."""
    assert live.admin.startswith(auth.TOKEN_PREFIX)
    engine = make_engine(live.url)
    print_first_admin_token(engine)  # what a second `db upgrade` does
    engine.dispose()
    assert first_token(capsys.readouterr().out) is None, "printed twice"

    code, worker, err = cli(
        capsys, "token", "create", "--scope", "worker", "--study", OWN, "--name", "gpu-box",
        "--database-url", live.url,
    )  # fmt: skip
    worker = worker.strip()
    assert code == 0 and worker.startswith(auth.TOKEN_PREFIX) and "gpu-box" in err
    me = whoami(live.server.url, worker)
    assert me.status_code == 200
    assert me.json() == {"name": "gpu-box", "scopes": ["worker"], "studies": [OWN]}
    issued = httpx.post(
        f"{live.server.url}/api/v1/tokens",
        json={"name": "reader", "scopes": ["read"]},
        headers=live.headers(),
    )
    assert issued.status_code == 201, issued.text
    reader = issued.json()["token"]
    assert whoami(live.server.url, reader).json()["scopes"] == ["read"]
    code, listed, _ = cli(capsys, "token", "list", "--database-url", live.url)
    assert code == 0 and "gpu-box" in listed and "reader" in listed

    clear_tokens = [live.admin, worker, reader]
    for token in clear_tokens:
        assert token not in listed
        assert token not in live.server.logs()
    engine = create_engine(live.url)
    with engine.connect() as connection:
        rows = connection.execute(text("SELECT token_hash FROM vramtune_tokens")).scalars().all()
    engine.dispose()
    assert {auth.hash_token(token) for token in clear_tokens} <= set(rows)
    stored = b"".join(path.read_bytes() for path in live.directory.glob("vramtune.db*"))
    for token in clear_tokens:  # the database file and its WAL
        assert token.encode() not in stored
        assert auth.hash_token(token).encode() in stored  # the scan does see the table


def test_cli_revoke_stops_a_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """token revoke by id; the token no longer authenticates; bad ids and scopes are errors."""
    url = migrated_sqlite(tmp_path)
    create = ["token", "create", "--scope", "read", "--json", "--database-url", url]
    code, out, _ = cli(capsys, *create)
    assert code == 0
    issued = json.loads(out)
    with TestClient(create_app(Settings(database_url=url, auth="on"))) as client:
        headers = {"Authorization": f"Bearer {issued['token']}"}
        assert client.get("/api/v1/studies", headers=headers).status_code == 200
        code, _, _ = cli(capsys, "token", "revoke", str(issued["id"]), "--database-url", url)
        assert code == 0
        assert client.get("/api/v1/studies", headers=headers).status_code == 401
    assert cli(capsys, "token", "revoke", "999", "--database-url", url)[0] == 1
    code, _, err = cli(capsys, "token", "create", "--scope", "root", "--database-url", url)
    assert code == 1 and "scopes" in err


def test_preset_admin_token_is_used_not_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """VRAMTUNE_ADMIN_TOKEN becomes the first admin token, hashed; it is never printed."""
    url = f"sqlite:///{tmp_path / 'vramtune.db'}"
    preset = "vt_preset_" + "k" * 40
    monkeypatch.setenv(ADMIN_TOKEN_ENV, preset)
    code, out, _ = cli(capsys, "db", "upgrade", "--database-url", url)
    assert code == 0 and preset not in out and ADMIN_TOKEN_ENV in out
    with TestClient(create_app(Settings(database_url=url, auth="on"))) as client:
        me = client.get("/api/v1/auth/whoami", headers={"Authorization": f"Bearer {preset}"})
        assert me.status_code == 200 and me.json()["scopes"] == ["admin"]
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "short")
    code, _, err = cli(capsys, "db", "upgrade", "--database-url", f"sqlite:///{tmp_path / 'b.db'}")
    assert code == 1 and ADMIN_TOKEN_ENV in err


def test_token_in_the_query_is_not_accepted(secured: Secured) -> None:
    """Tokens in URLs end up in logs and histories: only the Authorization header counts."""
    admin = secured.tokens["admin"]
    for query in ("access_token", "token", "api_key"):
        response = secured.client.get(f"/api/v1/studies?{query}={admin}")
        assert response.status_code == 401, query
    for header in (f"Basic {admin}", admin, f"Bearer  {BAD_TOKEN}", "Bearer"):
        response = secured.client.get("/api/v1/studies", headers={"Authorization": header})
        assert response.status_code == 401, header


def test_rest_token_lifecycle(secured: Secured) -> None:
    """Admins create, list and revoke tokens; the list never shows a token or its hash."""
    admin = secured.headers("admin")
    issued = secured.client.post(
        "/api/v1/tokens", json={"name": "ci", "scopes": ["read"], "studies": [OWN]}, headers=admin
    )
    assert issued.status_code == 201, issued.text
    body = issued.json()
    token = body["token"]
    assert body["studies"] == [OWN] and token.startswith(auth.TOKEN_PREFIX)
    listed = secured.client.get("/api/v1/tokens", headers=admin)
    assert token not in listed.text and auth.hash_token(token) not in listed.text
    assert "ci" in [t["name"] for t in listed.json()["tokens"]]
    bearer = {"Authorization": f"Bearer {token}"}
    assert secured.client.get(f"/api/v1/studies/{OWN}", headers=bearer).status_code == 200
    revoked = secured.client.delete(f"/api/v1/tokens/{body['id']}", headers=admin)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert secured.client.get(f"/api/v1/studies/{OWN}", headers=bearer).status_code == 401
    assert secured.client.delete("/api/v1/tokens/999999", headers=admin).status_code == 404
    for bad in ({"name": "x", "scopes": ["root"]}, {"name": "<b>", "scopes": ["read"]}):
        refused = secured.client.post("/api/v1/tokens", json=bad, headers=admin)
        assert refused.status_code == 422, refused.text


def test_auth_off_makes_everyone_the_local_admin(tmp_path: Path) -> None:
    """VRAMTUNE_AUTH=off: no token needed, whoami says so."""
    url = migrated_sqlite(tmp_path)
    with TestClient(
        create_app(Settings(database_url=url, auth="off", allowed_hosts=IN_PROCESS_HOSTS))
    ) as client:
        me = client.get("/api/v1/auth/whoami")
        assert me.status_code == 200
        assert me.json() == {"name": auth.LOCAL_ADMIN.name, "scopes": ["admin"], "studies": None}
        assert client.get("/api/v1/tokens").status_code == 200


@pytest.mark.parametrize(
    ("host", "auth_mode", "warns"),
    [("0.0.0.0", "off", True), ("::", "off", True), ("10.1.2.3", "off", True),
     ("127.0.0.1", "off", False), ("localhost", "off", False), ("::1", "off", False),
     ("0.0.0.0", "on", False)],
)  # fmt: skip
def test_warning_when_exposed_without_auth(
    caplog: pytest.LogCaptureFixture, host: str, auth_mode: str, warns: bool
) -> None:
    """Listening beyond loopback with auth off is logged as a warning at start."""
    with caplog.at_level(logging.WARNING, logger="vramtune.auth"):
        create_app(Settings(database_url="sqlite://", host=host, auth=auth_mode))
    warned = [r for r in caplog.records if "VRAMTUNE_AUTH=off" in r.getMessage()]
    assert bool(warned) == warns


def test_cli_tokens_expire_and_list_shows_expiry_and_last_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--expires 30d sets the expiry; `token list` shows it and the last use, never a secret;
    a bad duration is refused naming the field; an expired token is refused with a 401."""
    from datetime import datetime, timedelta

    url = migrated_sqlite(tmp_path)
    code, out, _ = cli(
        capsys,
        "token",
        "create",
        "--scope",
        "read",
        "--expires",
        "30d",
        "--json",
        "--database-url",
        url,
    )
    assert code == 0
    issued = json.loads(out)
    expires = datetime.fromisoformat(issued["expires_at"])
    created = datetime.fromisoformat(issued["created_at"])
    assert expires - created == timedelta(days=30)
    code, _, err = cli(
        capsys, "token", "create", "--scope", "read", "--expires", "soon", "--database-url", url
    )
    assert code == 1 and "expires_in" in err
    old = ["token", "create", "--scope", "read", "--name", "old", "--database-url", url]
    expired = cli(capsys, *old)[1].strip()
    engine = make_engine(url)
    with engine.begin() as connection:  # as if created long ago with a short lifetime
        past = {"t": utcnow() - timedelta(seconds=1)}
        connection.execute(
            text("UPDATE vramtune_tokens SET expires_at = :t WHERE name = 'old'"), past
        )
    engine.dispose()
    with TestClient(create_app(Settings(database_url=url, auth="on"))) as client:
        fresh = {"Authorization": f"Bearer {issued['token']}"}
        assert client.get("/api/v1/studies", headers=fresh).status_code == 200
        stale = client.get("/api/v1/studies", headers={"Authorization": f"Bearer {expired}"})
        assert stale.status_code == 401 and "expired" in stale.json()["detail"]
    code, listed, _ = cli(capsys, "token", "list", "--database-url", url)
    assert (
        code == 0 and "EXPIRES" in listed.splitlines()[0] and "LAST USED" in listed.splitlines()[0]
    )
    row = next(line for line in listed.splitlines() if line.split()[0] == str(issued["id"]))
    assert (
        issued["expires_at"][:10] in row and row.count(issued["created_at"][:10]) == 2
    )  # used today
    assert issued["token"] not in listed and expired not in listed
    code, as_json, _ = cli(capsys, "token", "list", "--json", "--database-url", url)
    assert all("token" not in entry and "token_hash" not in entry for entry in json.loads(as_json))
