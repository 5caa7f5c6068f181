"""The spool: a trial's final call kept on disk until the server has answered it.

A worker sends a trial's outcome (complete, fail or hand back) until the server answers; with
``--spool DIR`` the call is written to ``DIR`` first, one JSON file a call, and removed once
answered. A worker killed before that (SIGKILL, OOM killer, a reboot while the server was away)
finds the file at its next start and sends it again. The lease fences the replay: the server
takes it while the lease lives, answers a call it already took with the answer it stored, and
refuses it (409) once the trial was re-offered.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

log = logging.getLogger("vramtune.worker.spool")

FinalCall = Literal["complete", "fail", "handback"]
_CALLS: tuple[FinalCall, ...] = ("complete", "fail", "handback")


@dataclass(frozen=True)
class Spooled:
    """One kept call: which call, on which trial, its request body, and its file."""

    path: Path
    call: FinalCall
    trial_id: int
    body: dict[str, Any]
    kept_at: float


class Spool:
    """A folder of calls not yet answered; writes are atomic (a file is whole or absent)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def keep(self, call: FinalCall, trial_id: int, body: BaseModel) -> Spooled:
        """Write the call to disk (fsynced) before it is sent."""
        kept_at, dumped = time.time(), body.model_dump(mode="json")
        record = {"call": call, "trial_id": trial_id, "kept_at": kept_at, "body": dumped}
        name = f"{time.time_ns()}-{trial_id}-{call}.json"
        path = self.directory / name
        partial = self.directory / f".{name}.partial"
        with partial.open("w") as out:
            json.dump(record, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)  # atomic: a replay never reads half a file
        return Spooled(path, call, trial_id, dumped, kept_at)

    def answered(self, spooled: Spooled) -> None:
        """The server answered the call: forget it."""
        spooled.path.unlink(missing_ok=True)

    def pending(self) -> list[Spooled]:
        """Calls kept by an earlier run, oldest first; unreadable files are set aside."""
        found = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                record = json.loads(path.read_text())
                call = record["call"]
                if call not in _CALLS:
                    raise ValueError(f"unknown call {call!r}")
                found.append(
                    Spooled(
                        path,
                        call,
                        int(record["trial_id"]),
                        dict(record["body"]),
                        float(record["kept_at"]),
                    )
                )
            except (OSError, ValueError, KeyError, TypeError) as error:
                log.error("spool file %s unreadable (%s); renamed .bad", path, error)
                path.replace(path.with_suffix(".bad"))
        return found
