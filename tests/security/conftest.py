"""An app with auth on over a migrated SQLite database, tokens of every kind and two studies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from security_fixtures import TOKEN_KINDS, Live, Secured, first_token, migrated_sqlite

from vramtune.service.settings import Settings
from vramtune.service.testing import run_vramtune, server_factory


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """create_app with VRAMTUNE_AUTH=on, lifespan running, tokens of every kind."""
    from vramtune.service.app import create_app

    url = migrated_sqlite(tmp_path_factory.mktemp("secured"))
    app = create_app(Settings(database_url=url, auth="on"))
    with TestClient(app) as client:
        secured = Secured(app, client, url)
        for kind, (scopes, studies) in TOKEN_KINDS.items():
            secured.tokens[kind] = secured.add_token(scopes, studies)[1]
        secured.ensure_studies()
        yield secured


@pytest.fixture(scope="session")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A real server (uvicorn subprocess), auth on, 4 KiB body limit, on a database that
    `vramtune db upgrade` (a subprocess) created, with the admin token it printed."""
    directory = tmp_path_factory.mktemp("live")
    url = f"sqlite:///{directory / 'vramtune.db'}"
    no_preset = {"VRAMTUNE_ADMIN_TOKEN": ""}  # the token is generated and printed
    upgraded = run_vramtune("db", "upgrade", "--database-url", url, env=no_preset)
    assert upgraded.returncode == 0, upgraded.stderr
    admin = first_token(upgraded.stdout)
    assert admin is not None, upgraded.stdout
    with server_factory(directory) as start:
        yield Live(url, directory, admin, start(url, auth="on", max_request_bytes=4096))
