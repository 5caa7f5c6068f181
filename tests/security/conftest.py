"""An app with auth on over a migrated SQLite database, tokens of every kind and two studies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from security_fixtures import TOKEN_KINDS, Secured, migrated_sqlite

from service.settings import Settings


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """create_app with VRAMTUNE_AUTH=on, lifespan running, tokens of every kind."""
    from service.app import create_app

    url = migrated_sqlite(tmp_path_factory.mktemp("secured"))
    app = create_app(Settings(database_url=url, auth="on"))
    with TestClient(app) as client:
        secured = Secured(app, client, url)
        for kind, (scopes, studies) in TOKEN_KINDS.items():
            secured.tokens[kind] = secured.add_token(scopes, studies)[1]
        secured.ensure_studies()
        yield secured
