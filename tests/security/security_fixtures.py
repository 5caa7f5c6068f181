"""What the security tests share: token kinds, two studies, the Secured app wrapper."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from vramtune.service.auth import tokens as auth
from vramtune.service.db.engine import make_engine
from vramtune.service.db.migrate import upgrade
from vramtune.service.db.tables import StudyRow, TrialRow
from vramtune.service.state import utcnow
from vramtune.service.testing import ServerProcess

OWN, OTHER = "own-study", "other-study"
# kind -> (scopes, studies); "limited" may submit and run trials of OWN only.
TOKEN_KINDS: dict[str, tuple[list[str], list[str] | None]] = {
    "read": (["read"], None),
    "submit": (["submit"], None),
    "worker": (["worker"], None),
    "admin": (["admin"], None),
    "limited": (["submit", "worker"], [OWN]),
}
BAD_TOKEN = "vt_" + "x" * 43  # well-formed, never issued


def study_spec(name: str) -> dict[str, object]:
    """A small valid study of the built-in quadratic task."""
    return {
        "name": name,
        "task": "quadratic",
        "search_space": {"x": {"type": "float", "low": -1.0, "high": 1.0}},
        "n_trials": 5,
    }


def migrated_sqlite(directory: Path) -> str:
    """A SQLite file upgraded in-process (Optuna's tables and vramtune's)."""
    url = f"sqlite:///{directory / 'vramtune.db'}"
    engine = make_engine(url)
    try:
        upgrade(engine)
    finally:
        engine.dispose()
    return url


@dataclass
class Secured:
    """The app under test, its client, and what the tests address."""

    app: FastAPI
    client: TestClient
    url: str
    tokens: dict[str, str] = field(default_factory=dict)
    trials: dict[str, int] = field(default_factory=dict)

    def headers(self, kind: str) -> dict[str, str]:
        """Authorization for a token kind; none for "none", a forged token for "bad"."""
        if kind == "none":
            return {}
        token = BAD_TOKEN if kind == "bad" else self.tokens[kind]
        return {"Authorization": f"Bearer {token}"}

    def add_token(self, scopes: list[str], studies: list[str] | None = None) -> tuple[int, str]:
        """Store a token directly; its id and clear value."""
        with self.app.state.vt.sessions.begin() as session:
            row, clear = auth.create_token(session, "test", scopes, utcnow(), studies)
            return row.id, clear

    def ensure_studies(self) -> None:
        """OWN and OTHER exist, each with one trial known to vramtune (re-made if deleted)."""
        for name in (OWN, OTHER):
            with self.app.state.vt.sessions() as session:
                exists = session.scalar(select(StudyRow.study_id).where(StudyRow.name == name))
            if exists is None:
                response = self.client.post(
                    "/api/v1/studies", json=study_spec(name), headers=self.headers("admin")
                )
                assert response.status_code == 201, response.text
                self.trials[name] = self._add_trial(response.json()["id"])

    def _add_trial(self, study_id: int) -> int:
        storage = self.app.state.vt.storage
        trial_id = int(storage.create_new_trial(study_id))
        with self.app.state.vt.sessions.begin() as session:
            session.add(
                TrialRow(
                    trial_id=trial_id,
                    study_id=study_id,
                    number=storage.get_trial_number_from_id(trial_id),
                    status="pending",
                    attempt=0,
                    min_bytes=0,
                    plans_tried=[],
                    updated_at=utcnow(),
                )
            )
        return trial_id


def first_token(stdout: str) -> str | None:
    """The token `vramtune db upgrade` printed, if any."""
    lines = [line for line in stdout.splitlines() if line.startswith("first admin token")]
    return lines[0].rsplit(" ", 1)[1] if lines else None


@dataclass
class Live:
    """A real server with auth on, its database and the first admin token."""

    url: str
    directory: Path
    admin: str
    server: ServerProcess

    def headers(self, token: str | None = None) -> dict[str, str]:
        """Bearer headers (the admin's unless another token is given)."""
        return {"Authorization": f"Bearer {token or self.admin}"}
