"""A trial on several cards of one node: one spawned process per rank (gloo on CPU, NCCL on GPUs).

`RankGroupRunner.run` is a `RunsTrials`: the agent hands it a plan whose `world_size` is above 1
and gets one `RunResult` back, as from a one-card run. Each rank builds the model with the same
seed, wraps it as `vramtune.worker.predictor.distributed.wrap_for_strategy` does (DDP, or FSDP2 per
unit then the root, resharding after forward or not as the plan says: what the per-rank
prediction traced), and trains its share of the global
batch (batch / world size) with the worker's own loop and its own peak meter, so a simulated
card's limit is per rank. Rank 0 reports intermediate values through the parent; the answer
(prune or not) and any stop are broadcast to every rank, so all ranks leave at the same step.

Faults end the whole trial once: a rank that runs out of memory, raises or dies (a signal, an
exit) makes the parent kill every other rank (they would wait in a collective) and raise
`OutOfMemory` or `RunFailed` naming the rank. Every rank asks the kernel to kill it when the
worker dies (PR_SET_PDEATHSIG), so even a killed worker leaves no rank behind.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from typing import Any

from vramtune.service.wire import Measured, Plan, Strategy, TrainBudget
from vramtune.worker.trial.runner import (
    CardSpec,
    Config,
    OutOfMemory,
    Reporter,
    RunFailed,
    RunResult,
    Stopped,
)

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the parent looks at its ranks between messages
JOIN_S = 10.0  # how long a rank that finished gets to exit before it is killed
DEATH_SEEN_S = 2.0  # how long a rank's error waits for a peer's death to show (its cause)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def rank_device(device: str) -> tuple[str, dict[str, str]]:
    """The device a rank trains on and the environment that shows it only its own card.

    A CUDA rank sees one card (CUDA_VISIBLE_DEVICES), which it then calls cuda:0.
    """
    if device.startswith("cuda"):
        index = device.partition(":")[2] or "0"
        return "cuda:0", {"CUDA_VISIBLE_DEVICES": index}
    return "cpu", {}


def backend_for(device: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_config(config: Config, batch_param: str, world_size: int) -> dict[str, Any]:
    """A rank's configuration: its share of the global batch, everything else as asked."""
    batch = int(config[batch_param])
    if batch % world_size:
        raise RunFailed(f"{batch_param}={batch} does not split evenly over {world_size} ranks")
    return {**config, batch_param: batch // world_size}


@dataclass(frozen=True)
class RankJob:
    """What one rank process needs (pickled to it)."""

    rank: int
    world_size: int
    port: int
    device: str
    runner: Any  # a vramtune.worker.run.training.TorchTaskRunner (pickled with its task)
    config: dict[str, Any]
    plan: Plan
    strategy: Strategy
    budget: TrainBudget
    card: CardSpec
    threads: int


class RankGroupRunner:
    """Runs a planned trial on `devices[:plan.world_size]`, one process per rank.

    `threads`: torch threads per rank; None shares the cores among this trial's ranks (a node
    running trials side by side shares them among all its cards instead).
    """

    def __init__(self, runner: Any, devices: Sequence[str], threads: int | None = None) -> None:
        self.runner = runner
        self.devices = list(devices)
        self.threads = threads
        self.pids: list[int] = []  # the ranks of the run under way (tests watch them)

    def run(
        self, config: Config, plan: Plan, budget: TrainBudget, card: CardSpec, reporter: Reporter
    ) -> RunResult:
        """Spawn the ranks, relay rank 0's reports, and return the run's result."""
        world_size, strategy = plan.world_size, plan.strategy
        if strategy is None or not 1 < world_size <= len(self.devices):
            raise RunFailed(f"cannot run {world_size} ranks on {len(self.devices)} cards")
        shared = rank_config(config, self.runner.task.batch_size_param, world_size)
        group = _Group(world_size, reporter)
        port, threads = _free_port(), self.threads or max(1, (os.cpu_count() or 1) // world_size)
        for rank in range(world_size):
            device, _ = rank_device(self.devices[rank])
            job = RankJob(
                rank, world_size, port, self.devices[rank], self.runner, shared, plan,
                strategy, budget, _rank_card(card, device), threads,
            )  # fmt: skip
            group.start(job)
        self.pids = [p.pid for p in group.processes if p.pid is not None]
        try:
            return group.wait()
        finally:
            group.kill_all()
            self.pids = []


class _Group:
    """The parent's side of one distributed run: its processes, their messages, its verdict."""

    def __init__(self, world_size: int, reporter: Reporter) -> None:
        import multiprocessing

        self.context = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self.reporter = reporter
        self.messages = self.context.Queue()
        self.answers = self.context.Queue()
        self.stop = self.context.Event()
        self.stop_reason: str | None = None
        self.processes: list[SpawnProcess] = []
        self.done: dict[int, dict[str, Any]] = {}

    def start(self, job: RankJob) -> None:
        process = self.context.Process(
            target=rank_main,
            args=(job, self.messages, self.answers, self.stop),
            name=f"vramtune-rank-{job.rank}",
            daemon=True,
        )
        process.start()
        self.processes.append(process)

    def wait(self) -> RunResult:
        """Relay messages until every rank is done or one fails (then raise for the trial)."""
        while len(self.done) < self.world_size:
            # Before every message, not only when none came: rank 0 reporting each step would
            # otherwise keep the queue busy and a stop (SIGTERM, a pruned trial) unseen.
            self._check_stop()
            try:
                message = self.messages.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
                continue
            self._handle(message)
        return self._result()

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind, rank = message[0], message[1]
        if kind == "report":
            self.answers.put(self.reporter.report(message[2], message[3]))
        elif kind == "done":
            self.done[rank] = message[2]
        elif kind == "oom":
            measured = self._measured(message[3]) or Measured(peak_allocated_bytes=0)
            raise OutOfMemory(f"rank {rank}: {message[2]}", measured)
        elif kind == "stopped":
            reason = self.stop_reason or message[2]
            raise Stopped(reason, self._measured(message[3]))
        else:
            raise RunFailed(self._cause(rank, message[2]), self._measured(message[3]))

    def _cause(self, rank: int, error: str) -> str:
        """What to tell of a rank's error: a peer's death first, when one died.

        The ranks left behind by a dead one fail in their next collective ("connection closed
        by peer"), often before the parent sees the death: wait a moment for it.
        """
        deadline = time.monotonic() + DEATH_SEEN_S
        while time.monotonic() < deadline:
            dead = [
                (other, process.exitcode)
                for other, process in enumerate(self.processes)
                if other != rank and process.exitcode not in (None, 0)
            ]
            if dead:
                other, exitcode = dead[0]
                return f"rank {other} died ({_exit_words(exitcode or 0)}); rank {rank}: {error}"
            time.sleep(POLL_S / 4)
        return f"rank {rank}: {error}"

    def _check_stop(self) -> None:
        reason = self.reporter.stop_reason()
        if reason is not None and not self.stop.is_set():
            self.stop_reason = reason
            self.stop.set()

    def _check_alive(self) -> None:
        for rank, process in enumerate(self.processes):
            if process.exitcode is not None and rank not in self.done:
                self._drain()  # its last message may still be in the queue
                if rank not in self.done:
                    raise RunFailed(f"rank {rank} died ({_exit_words(process.exitcode)})")

    def _drain(self) -> None:
        while True:
            try:
                self._handle(self.messages.get(timeout=POLL_S))
            except queue.Empty:
                return

    def _result(self) -> RunResult:
        first = self.done[0]
        peaks = [self.done[rank]["peak"] for rank in range(self.world_size)]
        return RunResult(
            values=first["values"],
            measured=_measured_of(peaks, [self.done[r]["reserved"] for r in self.done]),
            duration_s=first["duration_s"],
            samples_per_s=(first["samples_per_s"] or 0.0) * self.world_size or None,
            steps=first["steps"],
        )

    def _measured(self, peak: int | None) -> Measured | None:
        return None if peak is None else Measured(peak_allocated_bytes=peak)

    def kill_all(self) -> None:
        """Kill every rank still alive and reap it: no rank outlives its trial."""
        for process in self.processes:
            process.join(timeout=JOIN_S if len(self.done) == self.world_size else 0)
            if process.is_alive():
                process.kill()
            process.join(timeout=JOIN_S)
        self.messages.close()
        self.answers.close()


def _measured_of(peaks: list[int], reserved: list[int | None]) -> Measured:
    known = [r for r in reserved if r is not None]
    return Measured(
        peak_allocated_bytes=max(peaks),
        peak_reserved_bytes=max(known) if known else None,
        rank_peak_bytes=peaks,
    )


def _exit_words(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _rank_card(card: CardSpec, device: str) -> CardSpec:
    """The node's card as one rank sees it: the same size (the per-rank limit), its device."""
    return CardSpec(info=card.info, constants=dict(card.constants), device=device)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# ---------------------------------------------------------------------- in the rank process


class RankReporter:
    """A rank's `Reporter`: rank 0 asks the parent; every rank learns the answer by broadcast."""

    def __init__(self, rank: int, messages: Any, answers: Any, stop: Any) -> None:
        self.rank = rank
        self.messages = messages
        self.answers = answers
        self.stop = stop

    def report(self, step: int, value: float) -> bool:
        """Rank 0's value goes to the server; all ranks prune together."""
        decision = False
        if self.rank == 0:
            self.messages.put(("report", 0, step, value))
            decision = bool(self.answers.get())
        return bool(_from_rank_0(decision))

    def stop_reason(self) -> str | None:
        """'stop' on every rank at the same step once the parent was told to stop."""
        return "stop" if _from_rank_0(self.rank == 0 and self.stop.is_set()) else None


def _from_rank_0(value: object) -> object:
    import torch.distributed as dist

    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when the worker that spawned it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def rank_main(job: RankJob, messages: Any, answers: Any, stop: Any) -> None:
    """One rank: join the group, train its share, tell the parent how it ended."""
    _die_with_parent()
    device, env = rank_device(job.device)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(job.threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    dist.init_process_group(backend_for(job.device), rank=job.rank, world_size=job.world_size)
    try:
        messages.put(_train_rank(job, device, RankReporter(job.rank, messages, answers, stop)))
    finally:
        messages.close()
        messages.join_thread()  # the message is out before the process may be killed
        dist.destroy_process_group()


def _train_rank(job: RankJob, device: str, reporter: RankReporter) -> tuple[Any, ...]:
    from torch.distributed.device_mesh import init_device_mesh

    from vramtune.worker.predictor.distributed import wrap_for_strategy

    mesh = init_device_mesh(device.split(":")[0], (job.world_size,))
    task = job.runner.task

    def wrap(model: Any) -> Any:
        return wrap_for_strategy(task, model, job.strategy, mesh, job.plan.reshard_after_forward)

    card = job.card
    began = time.monotonic()
    try:
        result = job.runner.run_wrapped(
            job.config, job.plan, job.budget, card, reporter, wrap=wrap, rank=job.rank
        )
    except OutOfMemory as oom:
        return ("oom", job.rank, str(oom), oom.measured.peak_allocated_bytes)
    except Stopped as stopped:
        return ("stopped", job.rank, str(stopped.reason), _peak(stopped.measured))
    except Exception as error:  # a rank's failure is the trial's, told with its rank
        logger.exception("rank %d failed", job.rank)
        return ("error", job.rank, f"{type(error).__name__}: {error}", None)
    done = {
        "values": result.values,
        "peak": result.measured.peak_allocated_bytes,
        "reserved": result.measured.peak_reserved_bytes,
        "duration_s": result.duration_s or time.monotonic() - began,
        "samples_per_s": result.samples_per_s,
        "steps": result.steps,
    }
    return ("done", job.rank, done)


def _peak(measured: Measured | None) -> int | None:
    return None if measured is None else measured.peak_allocated_bytes


__all__ = ["RankGroupRunner", "RankJob", "backend_for", "rank_config", "rank_device", "rank_main"]
