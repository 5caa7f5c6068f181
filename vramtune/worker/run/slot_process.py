"""A packed trial's own process: runs trials for the agent, one at a time, under a memory limit.

Each slot of a packing worker (worker/run/slots.py) is a long-lived child process, started with
``spawn`` (a fork of a process with threads and a torch runtime is not safe) and reused trial
after trial, so torch is imported once per slot, not once per trial. The agent keeps the REST
protocol, the leases and the heartbeats; the child only trains. Its `Reporter` is a proxy: each
``report``, and a ``stop_reason`` at most every 50 ms, is a round trip over the pipe to the
agent's reporter, so a packed trial is pruned and stopped as a run in the agent's own process is.

The memory limit is the trial's reservation: on a GPU the process's caching allocator is capped
with ``torch.cuda.set_per_process_memory_fraction`` (a real CUDA OOM past it), on a simulated
CPU card the tracker's limit (worker/device/memory.py, through the card the runner is given) is set
to it. Either way a trial that needs more than its prediction said runs out alone.

Messages, child → agent first: ``("ready", task names)`` once its tasks are imported. Then
agent → child: ``("run", task, config, plan, budget, card, limit_bytes)``, an
``("answer", value)`` to each request, ``None`` to exit. Child → agent: ``("report", step,
value)`` and ``("stop?",)`` (requests), then ``("done", kind, *payload)`` with kind one of
result, oom, stopped, failed (a run that trained, with its peak), error.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from vramtune.service.wire import Plan, TrainBudget
from vramtune.worker.run.slots import cuda_memory_fraction
from vramtune.worker.trial.runner import (
    CardSpec,
    Config,
    OutOfMemory,
    Reporter,
    RunFailed,
    RunResult,
    Stopped,
    TrialRunner,
)

# How often the agent's side looks whether a silent child is still alive.
_ALIVE_POLL_S = 0.5
# A packed trial asks the agent whether to stop at most this often (see _PipeReporter).
STOP_CHECK_S = 0.05
# How long a child gets to exit when asked before it is killed.
_EXIT_GRACE_S = 5.0


class SlotDied(RuntimeError):
    """The trial's process ended without an answer (killed, crashed): the trial fails."""


class RunnerSource(Protocol):
    """Where a slot process finds the worker's runners (they are rebuilt in the child).

    Contract:
        runners(): the runners by task name, as the agent has them; called once in the child.
    """

    def runners(self) -> Mapping[str, TrialRunner]: ...


@dataclass(frozen=True)
class Given:
    """Runners passed as objects (an agent built in code): pickled into the child."""

    given: Mapping[str, TrialRunner] = field(default_factory=dict)

    def runners(self) -> Mapping[str, TrialRunner]:
        """The runners themselves."""
        return self.given


class SlotProcess:
    """One child process and the agent's end of its pipe; `run` is a `TrialRunner.run`."""

    def __init__(self, source: RunnerSource, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self.process: BaseProcess = context.Process(
            target=slot_main, args=(child_end, source, threads), name="vramtune-slot", daemon=True
        )
        self.process.start()
        child_end.close()
        self.tasks: list[str] | None = None  # what the child runs, once it said it is ready

    def wait_ready(self) -> list[str]:
        """Wait until the child has imported its tasks; the task names it runs."""
        if self.tasks is None:
            kind, *payload = self._receive()
            if kind != "ready":
                raise SlotDied(f"the trial's process answered {kind!r} before it was ready")
            self.tasks = list(payload[0])
        return self.tasks

    @property
    def alive(self) -> bool:
        """Whether the child can take another trial."""
        return self.process.is_alive()

    def run(
        self,
        runner_task: str,
        config: Config,
        plan: Plan,
        budget: TrainBudget,
        card: CardSpec,
        limit_bytes: int,
        reporter: Reporter,
    ) -> RunResult:
        """Run the trial in the child under `limit_bytes`; raises as `TrialRunner.run` does
        (and `SlotDied` when the child ends without an answer)."""
        self.wait_ready()
        self._send(("run", runner_task, dict(config), plan, budget, card, limit_bytes))
        while True:
            message = self._receive()
            kind = message[0]
            if kind == "report":
                self._send(("answer", reporter.report(message[1], message[2])))
            elif kind == "stop?":
                self._send(("answer", reporter.stop_reason()))
            else:
                return _outcome(message)

    def close(self) -> None:
        """Ask the child to exit; kill it if it lingers."""
        with contextlib.suppress(OSError, ValueError):  # gone already
            self._conn.send(None)
        self.process.join(_EXIT_GRACE_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()

    def _exit(self) -> str:
        """How the child ended, in words."""
        code = self.process.exitcode
        return "still running" if code is None else f"exit code {code}"

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self._conn.send(message)
        except (OSError, ValueError) as error:
            raise SlotDied(f"the trial's process is gone ({self._exit()}): {error}") from error

    def _receive(self) -> tuple[Any, ...]:
        while not self._conn.poll(_ALIVE_POLL_S):
            if not self.process.is_alive():
                raise SlotDied(f"the trial's process died ({self._exit()})")
        try:
            message: tuple[Any, ...] = self._conn.recv()
        except (EOFError, OSError) as error:
            self.process.join(_EXIT_GRACE_S)
            raise SlotDied(f"the trial's process died ({self._exit()})") from error
        return message


def _outcome(message: tuple[Any, ...]) -> RunResult:
    """The child's final message as `TrialRunner.run` ends: a result or an exception."""
    _, kind, *payload = message
    if kind == "result":
        result: RunResult = payload[0]
        return result
    if kind == "oom":
        raise OutOfMemory(payload[0], payload[1])
    if kind == "stopped":
        raise Stopped(payload[0], payload[1])
    if kind == "failed":
        raise RunFailed(payload[0], payload[1])
    raise RuntimeError(payload[0])  # the task's own error, its message kept


class _PipeReporter:
    """The child's `Reporter`: every call is answered by the agent's reporter.

    Stop checks go to the agent at most every `STOP_CHECK_S` (the first one at once): a round
    trip costs both processes CPU, on every step of a small trial otherwise, and a stop order
    comes with a heartbeat, seconds apart, anyway.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._asked_at: float | None = None

    def report(self, step: int, value: float) -> bool:
        """Send an intermediate value; True when the study's pruner prunes the trial."""
        return bool(self._ask(("report", step, value)))

    def stop_reason(self) -> str | None:
        """Why the run must stop now, as the agent says."""
        now = time.monotonic()
        if self._asked_at is not None and now - self._asked_at < STOP_CHECK_S:
            return None
        self._asked_at = now
        answer = self._ask(("stop?",))
        return None if answer is None else str(answer)

    def _ask(self, request: tuple[Any, ...]) -> Any:
        self.conn.send(request)
        _, value = self.conn.recv()
        return value


def slot_main(conn: Connection, source: RunnerSource, threads: int) -> None:
    """The child: rebuild the runners, then run each trial the agent sends, until told to exit."""
    # Signals are the agent's to handle: it stops the trial through the reporter, and a child
    # that died of a terminal's Ctrl-C would lose the trial's measurements.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    runners = dict(source.runners())
    _limit_threads(threads)
    conn.send(("ready", sorted(runners)))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the agent is gone
            return
        if request is None:
            return
        _, task, config, plan, budget, card, limit_bytes = request
        runner = runners.get(task)
        conn.send(("done", *_run_one(runner, task, config, plan, budget, card, limit_bytes, conn)))


def _run_one(
    runner: TrialRunner | None,
    task: str,
    config: Config,
    plan: Plan,
    budget: TrainBudget,
    card: CardSpec,
    limit_bytes: int,
    conn: Connection,
) -> tuple[Any, ...]:
    """One trial in the child: the final message's kind and payload."""
    if runner is None:
        return ("error", f"task {task!r} is not installed in the trial's process")
    try:
        limited = limit_memory(card, limit_bytes)
        result = runner.run(config, plan, budget, limited, _PipeReporter(conn))
    except OutOfMemory as oom:
        return ("oom", str(oom), oom.measured)
    except Stopped as stopped:
        return ("stopped", str(stopped.reason), stopped.measured)
    except RunFailed as failure:  # it trained: its peak still goes to the server
        return ("failed", str(failure), failure.measured)
    except Exception as error:  # a broken configuration fails its trial, not the slot
        return ("error", str(error) or type(error).__name__)
    finally:
        _release_device(card)
    return ("result", result)


def _release_device(card: CardSpec) -> None:
    """An idle slot holds no cached GPU memory: the next trial's reservation starts clean."""
    if card.device.startswith("cuda"):
        from vramtune.worker.run.training import release_device_memory

        release_device_memory(_torch_device(card))


def limit_memory(card: CardSpec, limit_bytes: int) -> CardSpec:
    """The card as this process sees it: `limit_bytes` of it (the allocator capped on a GPU)."""
    info = card.info.model_copy(update={"free_bytes": min(limit_bytes, card.info.free_bytes)})
    if card.device.startswith("cuda"):
        import torch

        index = _torch_device(card).index or 0
        torch.cuda.set_device(index)  # a node's slot runs on the card it is given, not cuda:0
        total = torch.cuda.get_device_properties(index).total_memory
        context = int(card.constants.get("cuda_context_bytes", 0))
        torch.cuda.set_per_process_memory_fraction(
            cuda_memory_fraction(limit_bytes, context, total), index
        )
        torch.cuda.empty_cache()  # what the previous trial left reserved counts against the cap
    elif card.info.simulated:
        # The simulated card's limit is its size (run.training.meter_for): this trial's share.
        info = info.model_copy(update={"total_bytes": limit_bytes})
    return CardSpec(info=info, constants=dict(card.constants), device=card.device)


def _torch_device(card: CardSpec) -> Any:
    import torch

    return torch.device(card.device)


def _limit_threads(threads: int) -> None:
    """Give torch (when a task imported it) this process's share of the cores."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.set_num_threads(threads)
    # RuntimeError: the inter-op pool started already (an import-time op); its size stays.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(threads)
