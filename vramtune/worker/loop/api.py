"""The worker's REST client: the protocol of DESIGN.md section 2 over httpx and the wire models.

Only transport errors and 5xx answers are retried, with capped, fully jittered exponential
backoff: a 4xx is the server's considered answer and retrying it would change nothing. A 409 on
a trial call means the lease is lost (the trial was reaped and re-offered): `LeaseLost`, and the
agent drops the trial. Calls that carry a finished trial's outcome retry until the server takes
them, so a server restart loses no result.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel

from vramtune.common.logs import log_event
from vramtune.service.wire import (
    API_PREFIX,
    Assignment,
    Calibration,
    CompleteReply,
    CompleteRequest,
    FailRequest,
    HandBackRequest,
    Heartbeat,
    HeartbeatReply,
    NextRequest,
    ReportReply,
    ReportRequest,
    StartRequest,
    StepTimeFit,
    TrialAck,
    WorkerRegister,
    WorkerRegistered,
)

log = logging.getLogger("vramtune.worker.api")
Model = TypeVar("Model", bound=BaseModel)
# The calls that carry a trial's outcome and end its lease; each is answered once per lease
# (a repeat gets the stored answer), so they are retried until the server takes them.
FinalCall = Literal["complete", "fail", "handback"]
OnRetry = Callable[[str], None]


class LeaseLost(Exception):
    """409: the lease this call presented is expired or foreign; the trial is no longer ours."""


class Rejected(Exception):
    """A 4xx other than 409: the request itself is wrong; retrying cannot help."""

    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"{status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


class ServerUnavailable(Exception):
    """The server did not answer before the call gave up (deadline or cancel)."""


def backoff_delays(base_s: float, cap_s: float) -> Iterator[float]:
    """Full-jitter exponential backoff: uniform(0, min(cap, base * 2**n)) for n = 0, 1, ..."""
    attempt = 0
    while True:
        yield random.uniform(0.0, min(cap_s, base_s * 2**attempt))
        attempt = min(attempt + 1, 32)


class ServerClient:
    """Calls of the worker protocol; every method returns a wire model or raises."""

    def __init__(
        self,
        server: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        backoff_base_s: float = 0.2,
        backoff_cap_s: float = 5.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=server.rstrip("/") + API_PREFIX, headers=headers, timeout=timeout_s
        )
        self._backoff = (backoff_base_s, backoff_cap_s)
        # Whether a complete may ask for the next trial (CompleteRequest.next); False once a
        # server older than that field has refused it.
        self.leases_on_complete = True

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    # ------------------------------------------------------------ workers

    def register(
        self, body: WorkerRegister, cancel: threading.Event | None = None
    ) -> WorkerRegistered:
        """Announce the worker and its card; retried until the server answers or `cancel`."""
        return self._model(WorkerRegistered, "POST", "/workers", body, cancel=cancel)

    def heartbeat(
        self, worker_id: int, body: Heartbeat, retry_for_s: float | None = None
    ) -> HeartbeatReply:
        """Renew every lease of the worker; the reply may order trials stopped."""
        path = f"/workers/{worker_id}/heartbeat"
        return self._model(HeartbeatReply, "POST", path, body, retry_for_s=retry_for_s)

    def next(
        self, worker_id: int, body: NextRequest, cancel: threading.Event | None = None
    ) -> Assignment | None:
        """Ask for a trial: an assignment, or None when there is no work (204)."""
        response = self._send("POST", f"/workers/{worker_id}/next", body, cancel=cancel)
        if response.status_code == 204:
            return None
        return Assignment.model_validate_json(response.content)

    def stop_worker(self, worker_id: int, retry_for_s: float | None = 10.0) -> None:
        """Tell the server this worker leaves (its leases end now, not at expiry)."""
        self._send("POST", f"/workers/{worker_id}/stop", None, retry_for_s=retry_for_s)

    def calibration(
        self,
        card_model: str,
        torch_version: str,
        task: str,
        worker_id: int | None = None,
        retry_for_s: float | None = 10.0,
        study: str | None = None,
    ) -> Calibration:
        """The service's correction of predictions for this card model, torch and task (with
        ``worker_id``, this worker's own runs count before the fleet's quorum; with ``study``,
        the study's own runs count beside the fleet's)."""
        query = {
            "card_model": card_model,
            "torch_version": torch_version,
            "task": task,
        }
        if worker_id is not None:
            query["worker_id"] = str(worker_id)
        if study is not None:
            query["study"] = study
        response = self._send("GET", "/calibration", None, params=query, retry_for_s=retry_for_s)
        return Calibration.model_validate_json(response.content)

    def step_time(
        self,
        card_model: str,
        task: str,
        worker_id: int | None = None,
        retry_for_s: float | None = 10.0,
        study: str | None = None,
    ) -> StepTimeFit:
        """The fleet's step-time model for this card model and task (vramtune.service.step_time;
        with ``worker_id``, this worker's own runs count before the fleet's quorum; with
        ``study``, the study's own runs count beside the fleet's)."""
        query = {"card_model": card_model, "task": task}
        if worker_id is not None:
            query["worker_id"] = str(worker_id)
        if study is not None:
            query["study"] = study
        response = self._send("GET", "/step-time", None, params=query, retry_for_s=retry_for_s)
        return StepTimeFit.model_validate_json(response.content)

    # ------------------------------------------------------------ trials

    def start(self, trial_id: int, body: StartRequest) -> TrialAck:
        """The plan chosen and the prediction; the trial starts running."""
        return self._trial(TrialAck, trial_id, "start", body, None)

    def report(
        self, trial_id: int, body: ReportRequest, retry_for_s: float | None = None
    ) -> ReportReply:
        """An intermediate value; the reply says whether the pruner prunes."""
        return self._trial(ReportReply, trial_id, "report", body, retry_for_s)

    def complete(
        self, trial_id: int, body: CompleteRequest, retry_for_s: float | None = None
    ) -> TrialAck:
        """The trial's value(s); retried until delivered (idempotent under the same lease)."""
        return self.deliver("complete", trial_id, body, retry_for_s=retry_for_s)

    def fail(self, trial_id: int, body: FailRequest, retry_for_s: float | None = None) -> TrialAck:
        """The trial could not finish: OOM, error, interrupted or pruned."""
        return self.deliver("fail", trial_id, body, retry_for_s=retry_for_s)

    def hand_back(
        self, trial_id: int, body: HandBackRequest, retry_for_s: float | None = None
    ) -> TrialAck:
        """The trial does not fit this card; the server routes it."""
        return self.deliver("handback", trial_id, body, retry_for_s=retry_for_s)

    def deliver(
        self,
        call: FinalCall,
        trial_id: int,
        body: CompleteRequest | FailRequest | HandBackRequest,
        *,
        retry_for_s: float | None = None,
        cancel: threading.Event | None = None,
        on_retry: OnRetry | None = None,
    ) -> TrialAck:
        """A trial's final call, retried until answered; ``on_retry(problem)`` before each retry."""
        path = f"/trials/{trial_id}/{call}"
        try:
            response = self._send(
                "POST", path, body, retry_for_s=retry_for_s, cancel=cancel, on_retry=on_retry
            )
        except Rejected as error:
            if not (isinstance(body, CompleteRequest) and body.next and _refuses(error, "next")):
                raise
            # A server older than CompleteRequest.next: the result goes without the ask (it
            # must not be lost for it), and later completes do not ask.
            self.leases_on_complete = False
            log_event(log, "next_with_complete_refused", level=logging.WARNING, trial=trial_id)
            body = body.model_copy(update={"next": None})
            response = self._send(
                "POST", path, body, retry_for_s=retry_for_s, cancel=cancel, on_retry=on_retry
            )
        reply = CompleteReply if call == "complete" else TrialAck  # may hold the next trial
        return reply.model_validate_json(response.content)

    def _trial(
        self,
        model: type[Model],
        trial_id: int,
        call: str,
        body: BaseModel,
        retry_for_s: float | None,
    ) -> Model:
        return self._model(
            model, "POST", f"/trials/{trial_id}/{call}", body, retry_for_s=retry_for_s
        )

    # ------------------------------------------------------------ transport

    def _model(
        self,
        model: type[Model],
        method: str,
        path: str,
        body: BaseModel | None,
        *,
        retry_for_s: float | None = None,
        cancel: threading.Event | None = None,
    ) -> Model:
        response = self._send(method, path, body, retry_for_s=retry_for_s, cancel=cancel)
        return model.model_validate_json(response.content)

    def _send(
        self,
        method: str,
        path: str,
        body: BaseModel | None,
        *,
        params: dict[str, str] | None = None,
        retry_for_s: float | None = None,
        cancel: threading.Event | None = None,
        on_retry: OnRetry | None = None,
    ) -> httpx.Response:
        """One call, retried on transport errors and 5xx until `retry_for_s` or `cancel`."""
        # Unset optional fields are left out, not sent as null: a server older than a field
        # then still takes the call (its models forbid unknown fields), as long as it is unused.
        content = None if body is None else body.model_dump_json(exclude_none=True).encode()
        headers = {} if body is None else {"Content-Type": "application/json"}
        deadline = None if retry_for_s is None else time.monotonic() + retry_for_s
        for delay in backoff_delays(*self._backoff):
            try:
                response = self._http.request(
                    method, path, content=content, headers=headers, params=params
                )
            except httpx.TransportError as error:
                problem = f"{type(error).__name__}: {error}"
            else:
                if response.status_code < 500:
                    return _checked(response)
                problem = f"HTTP {response.status_code}"
            if deadline is not None and time.monotonic() + delay > deadline:
                raise ServerUnavailable(f"{method} {path}: {problem}")
            log_event(
                log,
                "retrying",
                level=logging.WARNING,
                call=f"{method} {path}",
                problem=problem,
                delay_s=round(delay, 2),
            )
            if on_retry is not None:
                on_retry(problem)
            if cancel is not None and cancel.wait(delay):
                raise ServerUnavailable(f"{method} {path}: cancelled after {problem}")
            if cancel is None:
                time.sleep(delay)
        raise AssertionError("backoff_delays never ends")


def _checked(response: httpx.Response) -> httpx.Response:
    """The response when it is a success; LeaseLost on 409, Rejected on other 4xx."""
    if response.status_code < 400:
        return response
    detail = _detail(response)
    if response.status_code == 409:
        raise LeaseLost(str(detail))
    raise Rejected(response.status_code, detail)


def _refuses(error: Rejected, field: str) -> bool:
    """Whether a 422 is FastAPI's answer to a body field the server does not know."""
    if error.status_code != 422 or not isinstance(error.detail, list):
        return False
    return any(
        isinstance(item, dict)
        and item.get("type") == "extra_forbidden"
        and item.get("loc") == ["body", field]
        for item in error.detail
    )


def _detail(response: httpx.Response) -> Any:
    try:
        return response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        return response.text
