"""Delivery: a trial's final call sent until the server answers it, kept in the spool meanwhile.

The agent takes no new trial before a final call is answered. A shutdown that finds the server
still away after its grace period leaves the call in the spool (with ``--spool``) for the next
start, which sends it again first (`replay_spool`); the lease fences the replay on the server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from vramtune.service.wire import (
    Assignment,
    CompleteRequest,
    FailRequest,
    HandBackRequest,
    TrialAck,
)
from vramtune.worker.loop.api import FinalCall, LeaseLost, Rejected, ServerClient, ServerUnavailable
from vramtune.worker.loop.events import AgentLog
from vramtune.worker.loop.outcomes import FinalRequest
from vramtune.worker.loop.spool import Spool, Spooled

_MODELS: dict[FinalCall, type[FinalRequest]] = {
    "complete": CompleteRequest,
    "fail": FailRequest,
    "handback": HandBackRequest,
}


class Delivery:
    """Sends final calls for one agent: retried until answered, or for a grace at shutdown."""

    def __init__(
        self,
        client: ServerClient,
        spool: Spool | None,
        log: AgentLog,
        stop: Callable[[], threading.Event],
        shutdown_grace_s: float,
    ) -> None:
        self.client = client
        self.spool = spool
        self.log = log
        # The agent's stop event may be replaced (run_forever(stop)): read it at each call.
        self._stop = stop
        self.shutdown_grace_s = shutdown_grace_s

    def deliver(self, call: FinalCall, assignment: Assignment, request: FinalRequest) -> TrialAck:
        """Send `request` until the server answers; raises ServerUnavailable past the grace."""
        kept = None if self.spool is None else self.spool.keep(call, assignment.trial_id, request)
        where = None if kept is None else str(kept.path)
        queued_at: list[float] = []

        def queued(problem: str) -> None:
            if not queued_at:  # said once: the retries themselves are logged by the client
                queued_at.append(time.monotonic())
                self.log.event("result_queued", assignment, call=call, problem=problem, spool=where)

        try:
            ack = self.client.deliver(
                call,
                assignment.trial_id,
                request,
                retry_for_s=self._retry_for_s(),
                on_retry=queued,
            )
        except ServerUnavailable:
            outcome = "result_kept" if kept else "result_lost"
            self.log.event(outcome, assignment, call=call, spool=where)
            raise
        except (LeaseLost, Rejected):
            self._answered(kept)
            raise
        self._answered(kept)
        if queued_at:
            waited = round(time.monotonic() - queued_at[0], 3)
            self.log.event(
                "delivered", assignment, call=call, resolution=ack.resolution, waited_s=waited
            )
        return ack

    def replay_spool(self) -> None:
        """Send the final calls an earlier run of this worker kept but never had answered."""
        if self.spool is None:
            return
        for kept in self.spool.pending():
            body = _MODELS[kept.call].model_validate(kept.body)
            if isinstance(body, CompleteRequest):  # a trial leased now would go unheard of
                body.next = None
            facts: dict[str, Any] = {"trial_id": kept.trial_id, "call": kept.call}
            facts["kept_s"] = round(time.time() - kept.kept_at, 1)
            try:
                ack = self.client.deliver(kept.call, kept.trial_id, body, cancel=self._stop())
            except LeaseLost as error:  # re-offered meanwhile: the trial is another's now
                self.log.event("replay_refused", **facts, detail=str(error))
            except Rejected as error:
                status = error.status_code
                self.log.event("replay_rejected", **facts, status=status, detail=str(error))
            else:
                self.log.event("delivered", **facts, replayed=True, resolution=ack.resolution)
            self.spool.answered(kept)

    def _answered(self, kept: Spooled | None) -> None:
        if self.spool is not None and kept is not None:
            self.spool.answered(kept)

    def _retry_for_s(self) -> float | None:
        """Outcomes are retried until delivered, except for a grace period when shutting down."""
        return self.shutdown_grace_s if self._stop().is_set() else None
