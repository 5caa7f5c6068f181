"""One `vramtune worker` process owned by an engine's unit of work (a Ray actor, a job step).

The engine runs the worker as a child process rather than in its own: the worker's SIGTERM
path (stop at the next step, hand the trial back, exit 0) is then the one `vramtune worker`
has and is tested with, whatever the engine does with signals in its own processes (Ray's
workers install handlers of their own). The child dies with its owner (Linux's
PR_SET_PDEATHSIG): a worker orphaned by a killed owner would keep a card busy that the
engine believes free, and its restarted owner would start a second worker on it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

# PR_SET_PDEATHSIG from <sys/prctl.h>: the signal the kernel sends a process when its parent dies.
_PR_SET_PDEATHSIG = 1
# What `stop` allows a worker to hand its trial back: a trial stops at its next step, so this
# must exceed the longest step of the fleet's tasks plus one REST call.
DEFAULT_GRACE_S = 60.0


@dataclass(frozen=True)
class WorkerSpec:
    """The `vramtune worker` command line of one card.

    `token` goes to the child in its environment (VRAMTUNE_TOKEN), never on its command line,
    which every user of the machine can read. `options` are further `vramtune worker` options
    as typed (e.g. ``("--tasks", "mytasks", "--plan-ahead")``).
    """

    server: str
    device: str = "cuda:0"
    memory_limit: str | None = None
    name: str | None = None
    token: str | None = field(default=None, repr=False)
    options: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        """The child's command: this interpreter's `vramtune` (`python -m vramtune`), so the
        worker runs in the environment its owner runs in, console script on PATH or not."""
        command = [sys.executable, "-m", "vramtune", "worker", "--server", self.server]
        command += ["--device", self.device]
        if self.memory_limit is not None:
            command += ["--memory-limit", self.memory_limit]
        if self.name is not None:
            command += ["--name", self.name]
        return [*command, *self.options]

    def environment(self) -> dict[str, str]:
        """The owner's environment, with the token when there is one."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.token is not None:
            env["VRAMTUNE_TOKEN"] = self.token
        return env


class WorkerProcess:
    """A running `vramtune worker`, stopped by SIGTERM so that it hands its trial back."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        # Its output goes where the owner's does (Ray forwards an actor's to the driver).
        self.process = subprocess.Popen(
            spec.argv(), env=spec.environment(), preexec_fn=_die_with_parent
        )

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.process.pid

    def poll(self) -> int | None:
        """Its exit code once it exited, else None."""
        return self.process.poll()

    def stop(self, grace_s: float = DEFAULT_GRACE_S) -> int:
        """SIGTERM, then SIGKILL if it has not handed back and exited within `grace_s`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the owner dies (Linux; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
