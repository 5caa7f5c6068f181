"""The heartbeat thread: the worker is alive, these are its trials, and any stop orders back.

Heartbeats name the trials the worker holds, from next's answer until the trial's final call
is settled: the server renews those leases only, so a lease whose answer never reached the
worker expires and its trial is offered again. A stop order reaches a trial while it runs.
Trials are kept by id, so that one worker may hold and run several at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from vramtune.service.wire import Assignment, Heartbeat, WorkerRegistered
from vramtune.worker.loop.api import LeaseLost, Rejected, ServerClient, ServerUnavailable
from vramtune.worker.loop.events import AgentLog

# Answers to a heartbeat that no retry will change: the token is not (or no longer) valid, or
# this worker is not the token's.
_CREDENTIALS_REFUSED = (401, 403)


@dataclass
class RunningTrial:
    """A trial being run now; the heartbeat thread sets `stop_reason` on a stop order."""

    assignment: Assignment
    stop_reason: str | None = None


class Heartbeats:
    """Beats every `heartbeat_interval_s` (at once after `hold`) on a daemon thread."""

    def __init__(
        self,
        client: ServerClient,
        free_bytes: Callable[[], int],
        log: AgentLog,
        on_refused: Callable[[Rejected], None],
    ) -> None:
        self.client = client
        self.free_bytes = free_bytes
        self.log = log
        # Called once when the server refuses the worker's token; the thread then ends.
        self.on_refused = on_refused
        self._held: set[int] = set()
        self._running: dict[int, RunningTrial] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._beat_now = threading.Event()

    def start(self, registered: WorkerRegistered) -> None:
        """Start beating for the registered worker."""
        self._thread = threading.Thread(
            target=self._loop, args=(registered,), name="vramtune-heartbeat", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop beating (waits a few seconds for a beat in flight)."""
        self._stop.set()
        self._beat_now.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def hold(self, trial_id: int) -> None:
        """The worker holds this trial now: renew its lease at once (it started ticking before
        a slow answer reached us)."""
        with self._lock:
            self._held.add(trial_id)
        self._beat_now.set()

    def release(self, trial_id: int) -> None:
        """The trial's final call is settled: its lease is no longer ours to renew."""
        with self._lock:
            self._held.discard(trial_id)

    def running(self, assignment: Assignment) -> RunningTrial:
        """A trial starts running: stop orders for it reach the returned object."""
        running = RunningTrial(assignment)
        with self._lock:
            self._running[assignment.trial_id] = running
        return running

    def finished(self, running: RunningTrial) -> None:
        """The trial's run ended: later stop orders for it are moot."""
        with self._lock:
            self._running.pop(running.assignment.trial_id, None)

    def stop_all(self, reason: str) -> None:
        """Order every running trial to stop, for `reason`."""
        with self._lock:
            for running in self._running.values():
                running.stop_reason = reason

    def _loop(self, registered: WorkerRegistered) -> None:
        interval = registered.heartbeat_interval_s
        while True:
            self._beat_now.wait(interval)
            self._beat_now.clear()
            if self._stop.is_set():
                return
            with self._lock:
                held = sorted(self._held)
            try:
                reply = self.client.heartbeat(
                    registered.worker_id,
                    Heartbeat(free_bytes=self.free_bytes(), trials=held),
                    retry_for_s=interval,
                )
            except Rejected as error:
                if error.status_code in _CREDENTIALS_REFUSED:
                    self.stop_all("token_refused")
                    self.on_refused(error)
                    return
                self.log.event("heartbeat_missed", error=str(error))
                continue
            except (ServerUnavailable, LeaseLost) as error:
                self.log.event("heartbeat_missed", error=str(error))
                continue
            for order in reply.stop:
                with self._lock:
                    running = self._running.get(order.trial_id)
                if running is not None:
                    running.stop_reason = order.reason
                    self.log.event("stop_ordered", running.assignment, reason=order.reason)
