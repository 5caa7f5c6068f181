"""The agent's structured log: one line per event, with the worker's and the trial's ids."""

from __future__ import annotations

import logging
from typing import Any

from vramtune.common.logs import log_event
from vramtune.service.wire import Assignment

log = logging.getLogger("vramtune.worker")


class AgentLog:
    """Writes the agent's events (vramtune.common.logs) under the worker's name and, once known,
    id."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.worker_id: int | None = None

    def event(self, name: str, assignment: Assignment | None = None, **fields: Any) -> None:
        """One structured log line, naming the trial when there is one."""
        ids: dict[str, Any] = {"worker": self.worker}
        if self.worker_id is not None:
            ids["worker_id"] = self.worker_id
        if assignment is not None:
            ids |= {
                "trial_id": assignment.trial_id,
                "number": assignment.number,
                "study": assignment.study,
            }
        log_event(log, name, **(ids | fields))
