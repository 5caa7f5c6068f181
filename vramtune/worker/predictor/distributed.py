"""Per-rank memory of a data-parallel trial: rank 0 of DDP or FSDP2 traced on a fake group.

`trace_rank` runs two training steps of rank 0 at world size W under FakeTensorMode, with
PyTorch's fake process group standing for the other ranks, and counts its storages with the
same `MemoryTracker` that measures real runs. The model is wrapped as the real rank wraps it
(`wrap_for_strategy`), so what is counted is what the wrappers allocate: FSDP2's sharded
parameters, gradients and optimizer state, its all-gather and reduce-scatter buffers and
prefetch, and with the plan's `reshard_after_forward` off every unit's gathered parameters held
from its forward to its backward; DDP's gradient buckets, built once at a first-step size and
rebuilt before step 2.
`measure_rank_peaks` is the real counterpart: W processes on `gloo`, each counting its own.

The global batch is the hyperparameter: each rank runs batch / W examples, split into the
plan's micro-batches (accumulation). Two places where the fake group cannot run DDP's C++
reducer as is are bridged, each allocating what the real path allocates:
- the fake group's all-reduce future carries no value, so the trace registers a comm hook that
  returns the bucket itself (gloo reduces in place: the default hook allocates nothing either);
- the reducer's construction (parameter-shape check) and its bucket rebuild before step 2
  fill integer tensors through raw pointers, so they run with those real (counted, as on a
  real rank) and the buckets fake.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.multiprocessing.spawn import spawn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vramtune.service.wire import Plan
from vramtune.worker.device import alloc_conf
from vramtune.worker.device.memory import MemoryTracker
from vramtune.worker.predictor.allocator import replay
from vramtune.worker.predictor.emulation import answer_scalar_reads
from vramtune.worker.predictor.trace import CannotTrace, correct_fake, untraceable_reason
from vramtune.worker.trial.steps import build_for_plan, build_optimizer_for_plan, train_step
from vramtune.worker.trial.task import Config, Task, TaskConfigError

Strategy = Literal["ddp", "fsdp"]
STRATEGIES: tuple[Strategy, ...] = ("ddp", "fsdp")
TRACED_STEPS = 2
"""Step 2 is the steady state: optimizer state exists and DDP's buckets are rebuilt."""


@dataclass(frozen=True)
class RankPrediction:
    """Rank 0's predicted peak at one world size.

    Attributes:
        allocated_bytes: the highest live tensor bytes (512-rounded storages), as
            `MemoryTracker` counts them on a real rank.
        reserved_bytes: what a CUDA caching allocator would reserve for this allocation
            sequence (`vramtune.worker.predictor.allocator.replay`); the kernels are the CPU's.
        breakdown: bytes live at the peak by category.
        seconds: the trace's wall time, process-group setup and teardown included.
    """

    allocated_bytes: int
    reserved_bytes: int
    breakdown: dict[str, int]
    seconds: float


def rank_batch_size(task: Task, config: Config, world_size: int) -> int:
    """Each rank's share of the global batch; the batch must split evenly over the ranks."""
    if world_size < 1:
        raise TaskConfigError(f"world size must be >= 1, got {world_size}")
    batch = int(config[task.batch_size_param])
    if batch % world_size:
        raise TaskConfigError(
            f"{task.batch_size_param}={batch} does not split evenly over {world_size} ranks"
        )
    return batch // world_size


def shard_units(task: Task, model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one before the root.

    A task that declares `shard_modules(model)` says so itself; else a transformers model names
    its layer classes in `_no_split_modules` (one `fully_shard` per decoder layer), and any other
    model shards its checkpointable blocks.
    """
    declared = getattr(task, "shard_modules", None)
    if callable(declared):
        return list(declared(model))
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    if layer_classes:
        return [m for m in model.modules() if type(m).__name__ in layer_classes]
    return list(task.checkpoint_modules(model))


def wrap_for_strategy(
    task: Task,
    model: nn.Module,
    strategy: Strategy,
    mesh: DeviceMesh,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """`model` as a rank trains it: DDP, or `fully_shard` per unit then the root.

    `reshard_after_forward` (FSDP2's, the plan's): True frees each unit's gathered parameters
    after its forward and gathers them again in backward; False keeps them gathered until
    backward is done (more memory, one all-gather a step fewer). DDP ignores it.
    """
    if strategy == "ddp":
        if not _is_fake(model):
            return DistributedDataParallel(model, process_group=mesh.get_group())
        with _real_index_tensors(model):
            ddp = DistributedDataParallel(model, process_group=mesh.get_group())
        _bridge_fake_reducer(ddp)
        return ddp
    if strategy == "fsdp":
        # None is FSDP2's default: every unit reshards after forward but the root, whose
        # parameters backward would gather again at once. An explicit True would reshard it too.
        reshard = None if reshard_after_forward else False
        for unit in shard_units(task, model):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model
    raise TaskConfigError(f"unknown strategy {strategy!r}; use one of {STRATEGIES}")


def run_rank_steps(
    task: Task,
    config: Config,
    plan: Plan,
    strategy: Strategy,
    mesh: DeviceMesh,
    tracker: MemoryTracker,
) -> list[float]:
    """Build, wrap and train `TRACED_STEPS` steps of one rank inside `tracker` (fake or real).

    Returns each step's wall seconds.
    """
    device = torch.device("cpu")
    batch_size = rank_batch_size(task, config, mesh.size())
    with torch.device(device):
        model = build_for_plan(task, config, plan, device)
    model = wrap_for_strategy(task, model, strategy, mesh, plan.reshard_after_forward)
    optimizer = build_optimizer_for_plan(task, model, config, plan)
    if plan.optimizer is not None:
        answer_scalar_reads(optimizer)
    tracker.watch_optimizer(optimizer)
    loss = None
    seconds = []
    for _ in range(TRACED_STEPS):
        started = time.perf_counter()
        loss = train_step(
            task,
            model,
            optimizer,
            lambda size: task.example_batch(config, size, device),
            batch_size,
            plan,
            device,
        )
        seconds.append(time.perf_counter() - started)
        tracker.label_training_state(model, optimizer)
    del loss
    return seconds


def trace_rank(
    task: Task, config: Config, plan: Plan, strategy: Strategy, world_size: int, rank: int = 0
) -> RankPrediction:
    """`rank`'s peak at `world_size`, traced on a fake process group it then destroys.

    Raises TaskConfigError for a configuration no rank can run, CannotTrace with a reason for
    one fake tensors cannot run (as the single-card trace does).
    """
    started = time.perf_counter()
    rank_batch_size(task, config, world_size)  # refused before any group exists
    tracker = MemoryTracker(device_type="cpu", record_events=True, correct=correct_fake)
    with fake_process_group(world_size, rank) as mesh:
        try:
            with FakeTensorMode(), tracker:
                run_rank_steps(task, config, plan, strategy, mesh, tracker)
        except (TaskConfigError, CannotTrace):
            raise
        except Exception as error:
            raise CannotTrace(untraceable_reason(error)) from error
    return RankPrediction(
        allocated_bytes=tracker.peak_bytes,
        reserved_bytes=replay(tracker.events or [], settings=alloc_conf.from_environ()).reserved,
        breakdown=tracker.breakdown(),
        seconds=time.perf_counter() - started,
    )


@contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[DeviceMesh]:
    """A 1-D CPU mesh over PyTorch's fake group as `rank`; destroyed on the way out.

    The mesh is built before any fake mode is entered (its rank bookkeeping must be real). A
    process that is already a rank of a real group cannot trace: the default group is global.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def _is_fake(model: nn.Module) -> bool:
    return any(isinstance(p, FakeTensor) for p in model.parameters())


@contextmanager
def _real_index_tensors(model: nn.Module) -> Iterator[None]:
    """Run DDP's C++ bookkeeping with its integer tensors real and its buckets fake.

    The reducer fills index and shape tensors through raw pointers, which fake tensors lack;
    they are small and short-lived, and the tracker counts them as it does on a real rank.
    """
    fake_mode = next(p for p in model.parameters() if isinstance(p, FakeTensor)).fake_mode
    with unset_fake_temporarily(), _RealIndicesFakeBuckets(fake_mode):
        yield


def _bridge_fake_reducer(ddp: DistributedDataParallel) -> None:
    """Let DDP's C++ reducer run on fake tensors (see the module docstring)."""

    def reduced_in_place(_state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    def rebuild_with_real_indices(module: nn.Module, _args: object) -> None:
        if torch.is_grad_enabled():
            with _real_index_tensors(module):
                ddp.reducer._rebuild_buckets()

    # DDP checks a hook's annotations as objects; postponed (string) ones fail its check.
    reduced_in_place.__annotations__.clear()
    ddp.register_comm_hook(None, reduced_in_place)
    # Before DDP.forward, where its own _pre_forward would rebuild: the same live set.
    ddp.register_forward_pre_hook(rebuild_with_real_indices)


class _RealIndicesFakeBuckets(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Integer factories and ops on real tensors run real; everything else in `fake_mode`."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.fake_mode = fake_mode

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors:
            real = not any(isinstance(t, FakeTensor) for t in tensors)
        else:
            real = kwargs.get("dtype") in (torch.int32, torch.int64)
        if real:
            return func(*args, **kwargs)
        with self.fake_mode:
            return func(*args, **kwargs)


# ---------------------------------------------------------------------- the real counterpart


@dataclass(frozen=True)
class RankRun:
    """One data-parallel run to measure: a task's configuration under a plan and a strategy."""

    task: Task
    config: Config
    plan: Plan
    strategy: Strategy


@dataclass(frozen=True)
class RankMeasurement:
    """A real run's tracked peak on each rank and rank 0's wall seconds per step."""

    peaks: list[int]
    step_seconds: list[float]


def measure_rank_peaks(runs: list[RankRun], world_size: int) -> list[RankMeasurement]:
    """Each rank's tracked peak over `TRACED_STEPS` real steps of each run, on gloo.

    W processes are spawned once for all the runs (start-up and imports dominate a small
    run); each run is built afresh and counted by a fresh tracker, so none sees another's
    tensors. The runs travel pickled.
    """
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    spawn(  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        _measure_ranks,
        args=(world_size, _free_port(), runs, results),
        nprocs=world_size,
        join=True,
    )
    by_rank = dict(results.get() for _ in range(world_size))
    return [
        RankMeasurement(
            peaks=[by_rank[rank][index][0] for rank in range(world_size)],
            step_seconds=by_rank[0][index][1],
        )
        for index in range(len(runs))
    ]


def _measure_ranks(
    rank: int, world_size: int, port: int, runs: list[RankRun], results: Any
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # W ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        measured = []
        for run in runs:
            tracker = MemoryTracker(device_type="cpu")
            with tracker:
                seconds = run_rank_steps(
                    run.task, run.config, run.plan, run.strategy, mesh, tracker
                )
            measured.append((tracker.peak_bytes, seconds))
            dist.barrier()
        results.put((rank, measured))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
