"""A small Python client of the study API; needs only httpx and the wire models."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from vramtune.service.wire import (
    API_PREFIX,
    ParetoFront,
    StudyCreate,
    StudyList,
    StudySummary,
    TrialPage,
)

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """The server answered with an error status; ``detail`` is its {"detail": ...}."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


class Client:
    """REST client of one vramtune server."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url + API_PREFIX, headers=headers, timeout=timeout_s
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self._http.request(method, path, **kwargs)
        if response.is_error:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ApiError(response.status_code, detail)
        return response

    def _get(self, model: type[M], path: str, **kwargs: Any) -> M:
        return model.model_validate_json(self._call("GET", path, **kwargs).content)

    def _post(self, model: type[M], path: str, **kwargs: Any) -> M:
        return model.model_validate_json(self._call("POST", path, **kwargs).content)

    def health(self) -> dict[str, str]:
        """The server's health answer."""
        result: dict[str, str] = self._call("GET", "/health").json()
        return result

    def create_study(self, spec: StudyCreate | dict[str, Any]) -> StudySummary:
        """Create a study from a spec (a StudyCreate or its JSON form)."""
        body = spec.model_dump(mode="json") if isinstance(spec, StudyCreate) else spec
        return self._post(StudySummary, "/studies", json=body)

    def list_studies(self) -> list[StudySummary]:
        """Every study."""
        return self._get(StudyList, "/studies").studies

    def get_study(self, name: str) -> StudySummary:
        """One study."""
        return self._get(StudySummary, f"/studies/{name}")

    def trials(
        self, name: str, states: Sequence[str] = (), offset: int = 0, limit: int = 100
    ) -> TrialPage:
        """A page of a study's trials, optionally only some TrialStates."""
        params: dict[str, Any] = {"offset": offset, "limit": limit}
        if states:
            params["state"] = [s.upper() for s in states]
        return self._get(TrialPage, f"/studies/{name}/trials", params=params)

    def best(self, name: str) -> ParetoFront:
        """The best trial(s): one, or the Pareto front."""
        return self._get(ParetoFront, f"/studies/{name}/best")

    def pareto_front(self, name: str) -> ParetoFront:
        """The Pareto front of a multi-objective study (the best trial otherwise)."""
        return self.best(name)

    def pause(self, name: str) -> StudySummary:
        """Stop handing out the study's trials."""
        return self._post(StudySummary, f"/studies/{name}/pause")

    def resume(self, name: str) -> StudySummary:
        """Hand out the study's trials again."""
        return self._post(StudySummary, f"/studies/{name}/resume")

    def delete(self, name: str) -> None:
        """Delete a study and its trials."""
        self._call("DELETE", f"/studies/{name}")

    def wait(self, name: str, timeout_s: float | None = None, poll_s: float = 1.0) -> StudySummary:
        """Poll until the study is done; TimeoutError after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            summary = self.get_study(name)
            if summary.state == "done":
                return summary
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"study {name!r} not done after {timeout_s} s ({summary.state})")
            time.sleep(poll_s)
