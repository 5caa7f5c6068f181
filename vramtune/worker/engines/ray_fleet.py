"""A vramtune fleet as Ray actors: one actor per card, each owning a `vramtune worker`.

Python entry point (what `vramtune ray up` runs)::

    import ray
    from vramtune.worker.engines.ray_fleet import FleetOptions, RayFleet, WorkerSpec

    ray.init(address="auto")
    fleet = RayFleet(WorkerSpec(server="http://tuner:8000", token=TOKEN), FleetOptions())
    fleet.run(stop)          # until `stop` (a threading.Event) is set, then hands trials back

What Ray does and what vramtune does:

- **Placement**: each actor asks Ray for `num_gpus` (1: one card; Ray sets
  CUDA_VISIBLE_DEVICES, so the worker's `cuda:0` is that card) and `num_cpus`. Simulated CPU
  cards (`device="cpu"`, a memory limit each) ask for no GPU.
- **Restarts**: an actor that dies (its node lost, `ray.kill`, its worker crashed) is restarted
  by Ray up to `max_restarts` times and starts a fresh worker. The trial the dead worker held
  is not lost: its lease expires and the service's reaper re-offers it (attempt + 1), or, when
  the worker outlived its actor long enough to see SIGTERM, it handed the trial back.
- **Stopping**: `stop()` sends each worker SIGTERM and waits for it to hand its trial back and
  exit (up to `grace_s`), so a stopped fleet leaves no trial to the reaper.
- **Sizing** (optional, `size_to_pending`): the fleet grows to the trials the service still
  needs a card for (capped by `max_workers`); workers it starts then exit by themselves after
  `idle_exit_s` without work, which shrinks it again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vramtune.service.wire import API_PREFIX, StudyList
from vramtune.worker.engines.process import DEFAULT_GRACE_S, WorkerProcess, WorkerSpec

log = logging.getLogger("vramtune.engines.ray")

NAMESPACE = "vramtune"  # the Ray namespace of the fleet's named actors
FINISHED_STATES = ("COMPLETE", "PRUNED", "FAIL")

__all__ = ["FleetOptions", "RayFleet", "WorkerActor", "WorkerSpec", "pending_trials"]


@dataclass(frozen=True)
class FleetOptions:
    """How many actors, what each asks Ray for, and how the fleet restarts and stops them."""

    workers: int = 1  # actors to start (with size_to_pending: the most it grows to)
    num_gpus: float = 1.0  # per actor: 1 for a real card, 0 for a simulated one
    num_cpus: float = 1.0
    max_restarts: int = 3  # Ray restarts a dead actor (and its worker) this many times
    grace_s: float = DEFAULT_GRACE_S  # a stopped worker's time to hand its trial back
    poll_s: float = 2.0  # how often the fleet checks its actors (and the pending trials)
    name: str = "vramtune"  # actor and worker names: NAME-0, NAME-1, ... in namespace vramtune
    size_to_pending: bool = False
    idle_exit_s: float = 60.0  # with size_to_pending: a worker without work for this long exits


class WorkerActor:
    """The body of one Ray actor: it owns a `vramtune worker` process for the actor's card."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.worker = WorkerProcess(spec)

    def pid(self) -> int:
        """The worker process's id."""
        return self.worker.pid

    def poll(self) -> int | None:
        """None while the worker runs; 0 once it exited by itself (idle, --max-trials).

        A worker that crashed takes its actor with it: Ray then restarts the actor, and with it
        the worker, as it restarts an actor whose node died.
        """
        code = self.worker.poll()
        if code not in (None, 0):
            log.error("worker %s exited with %s: restarting the actor", self.worker.pid, code)
            os._exit(1)
        return code

    def stop(self, grace_s: float) -> int:
        """SIGTERM the worker and wait for it to hand its trial back; its exit code."""
        return self.worker.stop(grace_s)


class RayFleet:
    """Named `WorkerActor`s on the connected Ray cluster (call `ray.init` first)."""

    def __init__(self, cards: WorkerSpec | Sequence[WorkerSpec], options: FleetOptions) -> None:
        """`cards`: one spec per kind of card; actor i runs `cards[i % len(cards)]`."""
        self.cards = [cards] if isinstance(cards, WorkerSpec) else list(cards)
        if not self.cards:
            raise ValueError("a fleet needs at least one worker spec")
        self.options = options
        self.actors: dict[str, Any] = {}  # name -> ActorHandle, the live ones
        self._started = 0

    def spec_of(self, index: int) -> WorkerSpec:
        """Worker `index`'s spec: its card's, named NAME-index, exiting when idle if sized."""
        spec = self.cards[index % len(self.cards)]
        options = spec.options
        if self.options.size_to_pending:
            options += ("--exit-when-idle", str(self.options.idle_exit_s))
        return dataclasses.replace(spec, name=f"{self.options.name}-{index}", options=options)

    def grow_to(self, count: int) -> None:
        """Start actors until `count` are live."""
        import ray

        actor_class = ray.remote(WorkerActor)
        while len(self.actors) < count:
            spec = self.spec_of(self._started)
            self._started += 1
            assert spec.name is not None
            self.actors[spec.name] = actor_class.options(
                name=spec.name,
                namespace=NAMESPACE,
                num_gpus=self.options.num_gpus,
                num_cpus=self.options.num_cpus,
                max_restarts=self.options.max_restarts,
            ).remote(spec)
            log.info("started actor %s (%s)", spec.name, spec.memory_limit or spec.device)

    def check(self) -> None:
        """Forget actors whose worker exited by itself or that Ray will not restart again."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

        polls = {name: actor.poll.remote() for name, actor in self.actors.items()}
        for name, pending in polls.items():
            try:
                code = ray.get(pending, timeout=max(self.options.poll_s, 10.0))
            except (ActorUnavailableError, GetTimeoutError):
                continue  # restarting, or not placed yet (no free card): ask again later
            except ActorDiedError as error:
                log.error("actor %s is gone for good: %s", name, error)
                del self.actors[name]
                continue
            if code == 0:
                log.info("worker %s exited by itself", name)
                ray.kill(self.actors.pop(name), no_restart=True)

    def stop(self) -> dict[str, int]:
        """SIGTERM every worker at once (each hands its trial back), then end the actors."""
        import ray
        from ray.exceptions import RayActorError

        stops = {name: a.stop.remote(self.options.grace_s) for name, a in self.actors.items()}
        codes: dict[str, int] = {}
        for name, pending in stops.items():
            try:
                codes[name] = ray.get(pending, timeout=self.options.grace_s + 30.0)
            except (RayActorError, ray.exceptions.GetTimeoutError) as error:
                log.error("actor %s did not stop cleanly: %s", name, error)
            ray.kill(self.actors[name], no_restart=True)
        self.actors.clear()
        return codes

    def run(self, stop: threading.Event, target: Callable[[], int] | None = None) -> None:
        """Keep the fleet at its size until `stop` is set or every worker exited by itself.

        `target()` (with size_to_pending) says how many workers are wanted now; the fleet grows
        to it, never past `options.workers`, and shrinks as idle workers exit.
        """
        self.grow_to(self._wanted(target))
        try:
            while not stop.wait(self.options.poll_s):
                self.check()
                self.grow_to(self._wanted(target))
                if not self.actors and not self.options.size_to_pending:
                    log.info("every worker exited: the fleet is done")
                    return
        finally:
            self.stop()

    def _wanted(self, target: Callable[[], int] | None) -> int:
        if not self.options.size_to_pending or target is None:
            return self.options.workers
        try:
            return min(self.options.workers, target())
        except Exception as error:  # the service unreachable a moment: keep the fleet as it is
            log.warning("cannot size the fleet: %s", error)
            return len(self.actors)


def pending_trials(server: str, token: str | None) -> int:
    """Trials the running studies still need a card for: each study's budget less its
    finished trials (a running trial holds a card too). Needs a token with the read scope."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(f"{server.rstrip('/')}{API_PREFIX}/studies", headers=headers, timeout=30)
    response.raise_for_status()
    studies = StudyList.model_validate(response.json()).studies
    return sum(
        max(0, study.n_trials - sum(study.counts.get(state, 0) for state in FINISHED_STATES))
        for study in studies
        if study.state == "running"
    )
