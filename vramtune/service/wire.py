"""The wire contract: every request and response body of the REST API.

This module imports nothing but pydantic (and the standard library) so that a worker-only
install and the Python client can use it without the server's dependencies. Field names are
the JSON names. Byte counts are plain integers; every float is finite but objective values
(ObjectiveValue).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

API_PREFIX = "/api/v1"

EXABYTE = 10**18
Bytes = Annotated[int, Field(ge=0, le=EXABYTE, description="A byte count, 0 to 10**18.")]
Finite = Annotated[float, Field(allow_inf_nan=False)]
# JSON has no infinity and no NaN: a non-finite objective value (an objective that returned
# inf, Optuna's placeholder of an infeasible trial, a NaN intermediate value) travels as one of
# these strings, which JavaScript's Number() and Python's float() (and so pydantic) read back.
# Never null: null is "no value", and a client's list[float] refused it (issue 49).
NON_FINITE = ("Infinity", "-Infinity", "NaN")


def wire_float(value: float) -> float | str:
    """A float as JSON carries it: itself when finite, else "Infinity", "-Infinity" or "NaN"."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


ObjectiveValue = Annotated[
    float,
    PlainSerializer(wire_float, when_used="json"),
    WithJsonSchema(
        {
            "anyOf": [{"type": "number"}, {"type": "string", "enum": list(NON_FINITE)}],
            "description": 'A number, or "Infinity", "-Infinity" or "NaN" when it is not finite.',
        }
    ),
]
Name = Annotated[
    str,
    Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Letters, digits, '.', '_' and '-', starting with a letter or digit.",
    ),
]
ShortText = Annotated[str, Field(max_length=4096)]
MetricName = Annotated[str, Field(min_length=1, max_length=64)]
Direction = Literal["minimize", "maximize"]
ParamValue = str | int | float | bool | None


def _as_utc(value: datetime) -> datetime:
    """Naive datetimes are UTC (as the database keeps them): say so, as RFC 3339 requires."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


UtcDatetime = Annotated[datetime, AfterValidator(_as_utc)]

MAX_PARAMS = 64
MAX_CHOICES = 256
MAX_SHARED_PREDICTIONS = 256  # per plan choice, and per assignment
MAX_SLOTS = 64  # trials one worker runs at once on its card (a packing worker's slots)
MAX_WORLD_SIZE = 64  # ranks of one distributed trial, and cards of one node worker
MAX_FLOAT_STEPS = 10**15  # grid points of a stepped float (Optuna's Decimal checks fail beyond)
Key = Annotated[str, Field(min_length=1, max_length=128)]
# A fixed setting or a sampler/pruner argument: a JSON scalar, finite, bounded in length.
# Smart union: JSON true stays a bool and 1.0 a float (left_to_right made them 1 and 1).
ConfigValue = Annotated[
    Annotated[str, Field(max_length=4096)] | int | Finite | bool | None,
    Field(union_mode="smart"),
]


class Wire(BaseModel):
    """Base of every wire model: unknown fields are an error, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- search space


class FloatParam(Wire):
    """A float in [low, high], optionally on a log scale or a step grid."""

    type: Literal["float"] = "float"
    low: Finite
    high: Finite
    log: bool = False
    step: Finite | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check_bounds(self) -> FloatParam:
        _check_range(self.low, self.high, self.log, self.step)
        if self.step is not None and (self.high - self.low) / self.step > MAX_FLOAT_STEPS:
            raise ValueError(f"at most {MAX_FLOAT_STEPS} steps between low and high")
        return self


class IntParam(Wire):
    """An integer in [low, high], optionally on a log scale or a step grid."""

    type: Literal["int"] = "int"
    low: int = Field(ge=-(2**53), le=2**53)
    high: int = Field(ge=-(2**53), le=2**53)
    log: bool = False
    step: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _check_bounds(self) -> IntParam:
        _check_range(self.low, self.high, self.log, None if self.step == 1 else self.step)
        return self


class CategoricalParam(Wire):
    """One of a list of choices (strings, numbers, booleans or null)."""

    type: Literal["categorical"] = "categorical"
    choices: list[Annotated[ParamValue, Field(union_mode="smart")]] = Field(
        min_length=1, max_length=MAX_CHOICES
    )

    @field_validator("choices")
    @classmethod
    def _check_choices(cls, choices: list[ParamValue]) -> list[ParamValue]:
        for choice in choices:
            if isinstance(choice, float) and not math.isfinite(choice):
                raise ValueError("choices must be finite (no NaN or infinity)")
            if isinstance(choice, str) and len(choice) > 256:
                raise ValueError("a choice is at most 256 characters")
        return choices


def _check_range(low: float, high: float, log: bool, step: float | None) -> None:
    if low > high:
        raise ValueError(f"low ({low}) must not exceed high ({high})")
    if not math.isfinite(high - low):
        raise ValueError("high - low must be a finite number")
    if log and low <= 0:
        raise ValueError(f"a log-scale parameter needs low > 0 (got {low})")
    if log and step is not None:
        raise ValueError("step and log cannot be combined")


Param = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]
SearchSpace = Annotated[
    dict[Annotated[str, Field(min_length=1, max_length=128)], Param],
    Field(min_length=1, max_length=MAX_PARAMS),
]


# ---------------------------------------------------------------- study


Resize = Literal[
    "micro_batch",
    "checkpointing",
    "selective_checkpointing",
    "chunked_cross_entropy",
    "bf16",
    "adamw_8bit",
    "adafactor",
    "activation_offload",
    "optimizer_offload",
]
"""The rungs of the plan ladder by name (docs/concepts/plans.md). All but bf16, adamw_8bit and
adafactor keep the numerics: those three are used only when a study lists them. The two offload
rungs are offered on CUDA cards only (on the CPU host and card are one memory)."""

PlanOptimizer = Literal["adamw_8bit", "adafactor"]
"""An optimizer a plan swaps in for the task's own (the adamw_8bit and adafactor rungs)."""


def _default_resizes() -> list[Resize]:
    return ["micro_batch", "checkpointing"]


class MemoryPolicy(Wire):
    """What a worker may do to a configuration that does not fit its card."""

    allow_resize: bool = Field(True, description="May a worker run a trial resized?")
    resizes: list[Resize] = Field(
        default_factory=_default_resizes,
        # Each rung once: 70,000 repeats were stored and sent with every study and assignment.
        max_length=len(get_args(Resize)),
        description=(
            "Rungs allowed, in any order: micro_batch, checkpointing (every block), "
            "selective_checkpointing (the fewest blocks that fit), chunked_cross_entropy (the "
            "vocabulary's logits in chunks), bf16, adamw_8bit (torchao's AdamW8bit for the "
            "task's optimizer: its state in 8 bits; the worker needs the optim8bit extra) and "
            "adafactor (torch.optim.Adafactor for the task's optimizer); these three change the "
            "numerics: only when listed, and only when nothing else fits. activation_offload "
            "and optimizer_offload (the forward's saved activations, or the optimizer's state "
            "and step, kept in host memory: CUDA cards only, the numerics kept, slower by the "
            "PCIe transfers). Each rung is tried alone with micro-batches; the rungs that keep "
            "the numerics are combined (each pair, then all) when none fits alone. The fitting "
            "plan of least predicted step time wins."
        ),
    )
    margin: Finite = Field(
        0.10, ge=0.0, le=0.9, description="Fraction of the card's free memory held back."
    )
    allow_packing: bool = Field(False, description="May a card run two trials at once?")

    @field_validator("resizes")
    @classmethod
    def _each_rung_once(cls, resizes: list[Resize]) -> list[Resize]:
        repeated = sorted({rung for rung in resizes if resizes.count(rung) > 1})
        if repeated:
            raise ValueError(f"each rung at most once; repeated: {repeated}")
        return resizes


Strategy = Literal["ddp", "fsdp"]


def world_size_field(description: str) -> Any:
    """A plan's or run's ranks, left out of the JSON at 1: a one-card body reads as before
    multi-GPU trials (an older server's models forbid unknown fields)."""
    return Field(
        1, ge=1, le=MAX_WORLD_SIZE, description=description, exclude_if=lambda size: size == 1
    )


def offload_field(description: str) -> Any:
    """An offload rung's flag, left out of the JSON when off: a plan without offload reads
    (and keys) as before the rung existed (an older server's models forbid unknown fields)."""
    return Field(False, description=description, exclude_if=lambda on: not on)


ACTIVATION_OFFLOAD = "The forward's saved activations kept in pinned host memory (CUDA only)."
OPTIMIZER_OFFLOAD = "The optimizer's state and step kept in host memory (CUDA only)."


def strategy_field() -> Any:
    """The data-parallel wrapper beside `world_size_field`, left out of the JSON when None."""
    return Field(
        None,
        description="The data-parallel wrapper; None: 1 rank.",
        exclude_if=lambda strategy: strategy is None,
    )


def reshard_field(description: str) -> Any:
    """FSDP2's `reshard_after_forward` beside `strategy_field`, left out of the JSON at its
    default (True), as the optimizer is when None: a body without it reads as before."""
    return Field(True, description=description, exclude_if=lambda reshard: reshard)


Prefer = Literal["fewest_cards", "fastest"]
"""How a distributed study chooses between more cards and resizing on one (vramtune/worker/plan/
distributed.py): the fewest cards that hold a trial as asked, or the fastest fitting plan."""


def _both_strategies() -> list[Strategy]:
    return ["ddp", "fsdp"]


class DistributedPolicy(Wire):
    """How a trial may be spread over several cards of one node, one process per rank.

    The global batch stays the hyperparameter: per-rank micro-batch x accumulation x world size.
    """

    strategies: list[Strategy] = Field(
        default_factory=_both_strategies,
        min_length=1,
        max_length=2,
        description="Data-parallel wrappers a worker may use, tried in this order at each "
        "world size: 'ddp' (DistributedDataParallel) and 'fsdp' (FSDP2 fully_shard).",
    )
    max_world_size: int = Field(
        8, ge=1, le=MAX_WORLD_SIZE, description="The most ranks (cards) one trial may use."
    )
    prefer: Prefer = Field(
        "fewest_cards",
        description="When one card cannot hold a trial as asked: 'fewest_cards' runs it as "
        "asked on the fewest ranks that hold it, resizing on one card only when none does; "
        "'fastest' runs whichever fitting plan (each world size and strategy as asked, or the "
        "single-card resized plan) the step-time model predicts fastest.",
    )

    @field_validator("strategies")
    @classmethod
    def _distinct(cls, strategies: list[Strategy]) -> list[Strategy]:
        if len(set(strategies)) != len(strategies):
            raise ValueError("each strategy at most once")
        return strategies


class SamplerSpec(Wire):
    """An Optuna sampler by name with its keyword arguments."""

    name: Literal["tpe", "random", "nsga2", "cmaes", "gp", "qmc", "grid"] = "tpe"
    args: dict[Key, ConfigValue] = Field(default_factory=dict, max_length=32)


class PrunerSpec(Wire):
    """An Optuna pruner by name with its keyword arguments."""

    name: Literal[
        "none", "median", "percentile", "hyperband", "successive_halving", "threshold", "patient"
    ] = "median"
    # a dict only for patient's wrapped_pruner ({name, args}), which the server validates
    args: dict[Key, ConfigValue | dict[str, Any]] = Field(default_factory=dict, max_length=32)

    @field_validator("args")
    @classmethod
    def _only_patient_wraps(cls, args: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        for key, value in args.items():
            if isinstance(value, dict) and key != "wrapped_pruner":
                raise ValueError(f"{key}: only wrapped_pruner takes an object")
        if info.context == STORED_SPEC:
            return args  # accepted before these rules existed: read as it was stored
        if "wrapped_pruner" in args and info.data.get("name") != "patient":
            raise ValueError("wrapped_pruner: only the patient pruner wraps another")
        if _wrapping_depth(args) > MAX_PRUNER_NESTING:
            raise ValueError(
                f"wrapped_pruner: at most {MAX_PRUNER_NESTING} pruners wrapped in each other"
            )
        return args


MAX_PRUNER_NESTING = 3
# Validation context of a study's stored spec: rules added after a study was accepted (such as
# MAX_PRUNER_NESTING) do not un-accept it, or every read of it would fail.
STORED_SPEC = {"stored": True}


def _wrapping_depth(args: dict[str, Any]) -> int:
    """How many wrapped_pruner objects nest inside each other, counted without recursion (a
    chain of 150 made the spec too deep to serialize), stopping past MAX_PRUNER_NESTING."""
    depth = 0
    wrapped = args.get("wrapped_pruner")
    while isinstance(wrapped, dict) and depth <= MAX_PRUNER_NESTING:
        depth += 1
        inner_args = wrapped.get("args")
        wrapped = inner_args.get("wrapped_pruner") if isinstance(inner_args, dict) else None
    return depth


class TrainBudget(Wire):
    """How long one trial trains: steps, seconds, or both (whichever ends first)."""

    max_steps: int | None = Field(200, ge=1, le=10**7)
    max_seconds: Finite | None = Field(None, gt=0, le=7 * 24 * 3600)
    eval_every: int = Field(50, ge=1, le=10**7, description="Steps between reported values.")

    @model_validator(mode="after")
    def _some_limit(self) -> TrainBudget:
        if self.max_steps is None and self.max_seconds is None:
            raise ValueError("set max_steps, max_seconds or both")
        return self


class StudyCreate(Wire):
    """A new study: what to tune, how, and within which memory policy."""

    name: Name
    task: Name = Field(description="A task name that workers advertise.")
    search_space: SearchSpace
    directions: list[Direction] = Field(default=["minimize"], min_length=1, max_length=2)
    minimize_peak_memory: bool = Field(
        False, description="Add the measured peak memory as an extra objective (minimized)."
    )
    metric_names: list[MetricName] | None = Field(
        None,
        max_length=2,
        description="The task's metric per direction, e.g. [accuracy]: how the dashboard "
        "names its axes (default: value).",
    )
    task_config: dict[Key, ConfigValue] = Field(
        default_factory=dict, max_length=64, description="Fixed task settings, not tuned."
    )
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)
    n_trials: int = Field(100, ge=1, le=10**6, description="Trial budget of the study.")
    budget: TrainBudget = Field(default_factory=TrainBudget)
    memory_policy: MemoryPolicy = Field(default_factory=MemoryPolicy)
    max_attempts: int = Field(3, ge=1, le=20, description="Attempts per trial before FAIL.")
    distributed: DistributedPolicy | None = Field(
        None,
        description="May a trial run on several cards of a node worker (DDP or FSDP2)? "
        "None: every trial runs on one card.",
    )

    @model_validator(mode="after")
    def _objectives(self) -> StudyCreate:
        if self.minimize_peak_memory and len(self.directions) > 1:
            raise ValueError("minimize_peak_memory takes a study with one direction")
        return self

    @field_validator("metric_names")
    @classmethod
    def _one_name_per_direction(
        cls, names: list[str] | None, info: ValidationInfo
    ) -> list[str] | None:
        directions = info.data.get("directions")
        if names is not None and directions is not None and len(names) != len(directions):
            raise ValueError(f"one name per direction: {len(directions)} direction(s)")
        return names

    @property
    def objective_directions(self) -> list[Direction]:
        """The Optuna study's directions, with peak memory appended when asked for."""
        extra: list[Direction] = ["minimize"] if self.minimize_peak_memory else []
        return [*self.directions, *extra]


StudyState = Literal["running", "paused", "done"]


class StudySummary(Wire):
    """A study as listed: its spec, state and trial counts."""

    id: int
    name: str
    task: str
    state: StudyState
    directions: list[Direction]
    n_trials: int
    counts: dict[str, int] = Field(description="Trials by Optuna TrialState name.")
    best_value: ObjectiveValue | None = None
    created_at: UtcDatetime
    spec: StudyCreate
    warnings: list[str] = Field(
        default_factory=list,
        description="What may keep the study from running, e.g. no live worker offers its task.",
    )


class StudyList(Wire):
    """A page of studies."""

    studies: list[StudySummary]


class PlanOut(Wire):
    """How a trial was run (see Plan)."""

    micro_batch: int | None = None
    accumulation: int = 1
    checkpointing: bool = False
    checkpoint_blocks: int | None = None
    chunked_loss: bool = False
    bf16: bool = False
    # Left out when None, as in Plan.
    optimizer: PlanOptimizer | None = Field(
        None,
        description="The optimizer swapped in (changes the numerics); None: the task's own.",
        exclude_if=lambda optimizer: optimizer is None,
    )
    # Left out when off, as in Plan.
    activation_offload: bool = offload_field(ACTIVATION_OFFLOAD)
    optimizer_offload: bool = offload_field(OPTIMIZER_OFFLOAD)
    # Left out for one card, as in Plan.
    world_size: int = world_size_field("Ranks (cards) it ran on.")
    strategy: Strategy | None = strategy_field()
    reshard_after_forward: bool = reshard_field(
        "FSDP2: True freed each unit's gathered parameters after forward; False kept them."
    )
    reason: str = ""


class TrialOut(Wire):
    """One trial with what vramtune knows about its memory."""

    id: int
    number: int
    state: str
    values: list[ObjectiveValue] | None = Field(
        None,
        description="The objective values; none for a trial not finished, and for an infeasible "
        "one (no card of the fleet could hold it: Optuna keeps placeholder values for it).",
    )
    params: dict[str, ParamValue]
    intermediate: dict[int, ObjectiveValue] = Field(default_factory=dict)
    datetime_start: UtcDatetime | None = None
    datetime_complete: UtcDatetime | None = None
    duration_s: float | None = None
    attempt: int = 0
    plan: PlanOut | None = None
    worker: str | None = None
    card_model: str | None = None
    predicted_peak_bytes: int | None = Field(
        None, description="Predicted peak; per rank when the plan's world size is above 1."
    )
    measured_peak_bytes: int | None = Field(
        None, description="Measured peak; the largest rank's when the world size is above 1."
    )
    rank_peak_bytes: list[int] | None = Field(
        None, description="A distributed run's measured peak on each rank, rank 0 first."
    )
    outcome: str | None = Field(
        None, description="as_asked, resized, routed, infeasible, oom, failed, pruned."
    )
    told_outcome: str | None = Field(
        None,
        description="The most informative outcome: how it ran and how it ended when they differ "
        "('routed, pruned', 'resized, oom').",
    )
    planning_s: float | None = Field(None, description="Seconds the worker took to choose a plan.")
    planning_since: UtcDatetime | None = Field(
        None,
        description="While a worker holds the trial and chooses its plan (leased, not started "
        "yet): when it leased it.",
    )
    prediction_source: PredictionSource | None = None
    user_attrs: dict[str, Any] = Field(default_factory=dict)


class TrialPage(Wire):
    """A page of trials, newest last."""

    trials: list[TrialOut]
    total: int
    offset: int
    limit: int


class ParetoFront(Wire):
    """The best trial(s): one for a single objective, the Pareto front otherwise."""

    trials: list[TrialOut]


# ---------------------------------------------------------------- workers


class CardInfo(Wire):
    """The card a worker drives (a simulated one for --device cpu)."""

    model: str = Field(min_length=1, max_length=256, description="e.g. 'NVIDIA H200'.")
    total_bytes: int = Field(gt=0, le=EXABYTE, description="The card's memory, 1 to 10**18.")
    free_bytes: Annotated[Bytes, Field(description="At most total_bytes.")]
    device_index: int = Field(0, ge=0, le=1024)
    uuid: str | None = Field(None, max_length=128)
    driver_version: str | None = Field(None, max_length=64)
    cuda_version: str | None = Field(None, max_length=64)
    torch_version: str | None = Field(None, max_length=64)
    simulated: bool = False
    # The worker's PYTORCH_CUDA_ALLOC_CONF as it read it (None: unset, PyTorch's defaults):
    # predictions for this card follow the same allocator rules.
    alloc_conf: str | None = Field(
        None, max_length=1024, description="PYTORCH_CUDA_ALLOC_CONF as the worker read it."
    )

    @field_validator("free_bytes")
    @classmethod
    def _at_most_total(cls, free: int, info: ValidationInfo) -> int:
        total = info.data.get("total_bytes")  # absent when total_bytes itself was refused
        if total is not None and free > total:
            raise ValueError(f"free_bytes ({free}) is more than total_bytes ({total})")
        return free


class CardConstants(Wire):
    """Memory a trace cannot see, measured by the worker on its own card at start."""

    cuda_context_bytes: Bytes = 0
    cublas_workspace_bytes: Bytes = 0
    other_bytes: Bytes = 0


class WorkerRegister(Wire):
    """A worker announcing itself and its card."""

    name: Name
    device: str = Field(pattern=r"^(cpu|cuda(:\d{1,4})?)$", description="'cpu' or 'cuda:N'.")
    card: CardInfo
    tasks: list[Name] = Field(min_length=1, max_length=256)
    constants: CardConstants = Field(default_factory=CardConstants)
    shape_params: dict[Name, list[Key]] = Field(
        default_factory=dict,
        max_length=256,
        description="Per task, the configuration keys its memory depends on (shape parameters "
        "and the batch size): predictions are shared across the fleet by their values. A task "
        "not listed is keyed by its whole configuration.",
    )
    slots: int = Field(
        1,
        ge=1,
        le=MAX_SLOTS,
        description="Trials the worker runs at once on its card: it may hold this many leases, "
        "and one more leased ahead (--plan-ahead).",
    )
    batch_params: dict[Name, Key] = Field(
        default_factory=dict,
        max_length=256,
        description="Per task, the configuration key holding its batch size: a study of the "
        "task whose search space and task_config both lack it is refused at creation.",
    )
    cards: list[CardInfo] | None = Field(
        None,
        max_length=MAX_WORLD_SIZE,
        description="A node worker's cards, one per rank (None: the one `card`). A trial of "
        "a study with `distributed` may run on several of them at once.",
    )
    # Each rung once at most: a list longer than the ladder is refused, not stored.
    rungs: dict[Name, Annotated[list[Resize], Field(max_length=16)]] | None = Field(
        None,
        max_length=256,
        description="Per task, the rungs of the plan ladder its plans can use on this worker's "
        "card (a PlainTask without checkpointable blocks has no checkpointing; a Trainer or "
        "Lightning task no optimizer swap or offload; a CPU card no offload): the dashboard's "
        "advice suggests no rung that no live worker can use. None (older workers): unknown, "
        "so every rung may be advised.",
    )

    @field_validator("shape_params")
    @classmethod
    def _few_shape_params(cls, shapes: dict[str, list[str]]) -> dict[str, list[str]]:
        if any(len(keys) > MAX_PARAMS for keys in shapes.values()):
            raise ValueError(f"a task has at most {MAX_PARAMS} shape parameters")
        return shapes


class WorkerRegistered(Wire):
    """The server's answer to a registration."""

    worker_id: int
    heartbeat_interval_s: float
    lease_ttl_s: float


class Heartbeat(Wire):
    """A worker is alive; renews the leases of the trials it runs."""

    free_bytes: Bytes | None = None
    trials: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        max_length=1024,
        description="The trials the worker is running now: only their leases are renewed, so a "
        "lease whose assignment never reached the worker (a lost reply to next) expires and its "
        "trial is offered again. None (older workers): every lease of the worker is renewed.",
    )


StopReason = Literal["pruned", "paused", "deleted", "lease_lost"]


class StopOrder(Wire):
    """Stop running this trial."""

    trial_id: int
    reason: StopReason


class HeartbeatReply(Wire):
    """Trials the worker must stop, if any."""

    stop: list[StopOrder] = Field(default_factory=list)


class NextRequest(Wire):
    """A worker asks for work, stating what it can give now."""

    free_bytes: Bytes
    free_cards: int | None = Field(
        None,
        ge=1,
        le=MAX_WORLD_SIZE,
        description="A node worker's cards that no trial of it holds now (each of `free_bytes`): "
        "it is offered no trial known to need more. None: all its cards (a one-card worker).",
    )


class Assignment(Wire):
    """A trial leased to one worker: everything it needs to run it."""

    trial_id: int
    number: int
    attempt: int
    lease: str = Field(description="Fencing token: present it on every call for this trial.")
    lease_expires_at: UtcDatetime
    study: str
    task: str
    params: dict[str, ParamValue]
    task_config: dict[str, ParamValue]
    budget: TrainBudget
    memory_policy: MemoryPolicy
    n_objectives: int = Field(description="Values the complete call must carry.")
    minimize_peak_memory: bool = False
    plans_tried: list[PlanOut] = Field(
        default_factory=list, description="Plans that already ran out of memory on this card model."
    )
    predictions: list[SharedPrediction] = Field(
        default_factory=list,
        description="Predictions the fleet already made for this trial's task and shape on "
        "this worker's card model and torch version: used instead of tracing again.",
    )
    larger_card_bytes: Bytes | None = Field(
        None,
        description="The largest live card of another worker for this task, when larger than "
        "this worker's: a trial much slower here resized may be handed back to it.",
    )
    distributed: DistributedPolicy | None = Field(
        None, description="The study's distributed policy: may it run on several cards?"
    )
    min_world_size: int = Field(
        1, ge=1, le=MAX_WORLD_SIZE, description="Ranks a hand-back said the trial needs."
    )


class Plan(Wire):
    """How a worker runs a trial: the same hyperparameters, maybe a smaller footprint."""

    micro_batch: int | None = Field(
        None, ge=1, le=10**7, description="None: the whole batch (a rank's share of it)."
    )
    accumulation: int = Field(1, ge=1, le=10**7)
    checkpointing: bool = False
    checkpoint_blocks: int | None = Field(
        None,
        ge=1,
        le=10**5,
        description="With checkpointing: the first k blocks recompute their forward; None: all.",
    )
    chunked_loss: bool = Field(False, description="Cross-entropy over the vocabulary in chunks.")
    bf16: bool = False
    # Left out when None, as world_size is: a plan without it reads (and keys) as before.
    optimizer: PlanOptimizer | None = Field(
        None,
        description="adamw_8bit: torchao's AdamW8bit (AdamW, its state in 8 bits) at the task "
        "optimizer's hyperparameters; adafactor: torch.optim.Adafactor at the task's learning "
        "rate; either instead of the task's optimizer (changes the numerics); None: the task's "
        "own.",
        exclude_if=lambda optimizer: optimizer is None,
    )
    # Left out when off, as optimizer is when None.
    activation_offload: bool = offload_field(ACTIVATION_OFFLOAD)
    optimizer_offload: bool = offload_field(OPTIMIZER_OFFLOAD)
    # Left out for one card: a server that predates multi-GPU trials (its Plan forbids unknown
    # fields) still takes every one-card call of a newer worker.
    world_size: int = world_size_field("Ranks (cards) it runs on.")
    strategy: Strategy | None = strategy_field()
    reshard_after_forward: bool = reshard_field(
        "FSDP2: True frees each unit's gathered parameters after forward (usually the least "
        "memory; gathered again in backward); False keeps them gathered until backward (one "
        "all-gather a step fewer). Only FSDP2 plans may set it False."
    )
    reason: ShortText = ""

    @model_validator(mode="after")
    def _strategy_with_ranks(self) -> Plan:
        """A strategy with several ranks only, and FSDP2's resharding choice with FSDP2 only."""
        if (self.world_size > 1) != (self.strategy is not None):
            raise ValueError("a strategy goes with a world size above 1, and only then")
        if not self.reshard_after_forward and self.strategy != "fsdp":
            raise ValueError("reshard_after_forward=false goes with the fsdp strategy only")
        return self

    @model_validator(mode="after")
    def _offload_on_one_card(self) -> Plan:
        # The offload rungs are one card's (worker/trial/offload.py): no ladder of ranks offers
        # them, and their plan_column suffixes fit the key's 64 characters beside no ranks.
        if self.world_size > 1 and (self.activation_offload or self.optimizer_offload):
            raise ValueError("the offload rungs run on one card: world_size must be 1")
        return self


class Prediction(Wire):
    """A predicted peak and how it was reached."""

    peak_allocated_bytes: Bytes
    peak_reserved_bytes: Bytes
    breakdown: dict[str, Bytes] = Field(default_factory=dict, max_length=64)
    constants: dict[str, Bytes] = Field(default_factory=dict, max_length=64)
    method: Literal["trace", "probe", "none"] = "trace"
    reason: ShortText = Field("", description="Why tracing was not possible, when it was not.")
    seconds: Finite = Field(0.0, ge=0)
    training_peak_bytes: Bytes | None = Field(
        None,
        description="The training steps' footprint alone, before calibration (what a "
        "calibration is fitted on); None from a worker that predicts the run as one peak.",
    )
    evaluation_peak_bytes: Bytes | None = Field(
        None,
        description="The evaluation's traced footprint, before calibration; None where it was "
        "not traced (the reason then says how it is bounded).",
    )


class SharedPrediction(Wire):
    """One prediction as the fleet shares it: a task's shape under a plan, on one card model
    and torch version (the reporting worker's), and what it predicted (before calibration)."""

    shape: dict[Key, ParamValue] = Field(
        max_length=2 * MAX_PARAMS,  # a task without shape keys: task_config and params
        description="The configuration's shape parameters' values.",
    )
    plan: Plan
    prediction: Prediction


PredictionSource = Literal["fleet", "worker", "mixed"]


class PlanChoice(Wire):
    """How a worker chose a trial's plan: how long it took, and where the predictions came from."""

    planning_s: Finite | None = Field(None, ge=0, description="Seconds spent choosing the plan.")
    prediction_source: PredictionSource | None = Field(
        None,
        description="'fleet': every prediction came with the assignment, none was traced; "
        "'worker': all were made by this worker; 'mixed': some of each.",
    )
    predictions: list[SharedPrediction] = Field(
        default_factory=list,
        max_length=MAX_SHARED_PREDICTIONS,
        description="The predictions this worker made for the choice, for the fleet to share.",
    )


class Measured(Wire):
    """Peaks measured while the trial ran."""

    peak_allocated_bytes: Bytes
    peak_reserved_bytes: Bytes | None = None
    nvml_peak_bytes: Bytes | None = None
    training_peak_bytes: Bytes | None = Field(
        None,
        description="The bytes the card held while training, evaluation excluded (reserved "
        "where known, else allocated); None from a worker that measures the run as one peak.",
    )
    evaluation_peak_bytes: Bytes | None = Field(
        None,
        description="The bytes the card held while the task evaluated; None when it never did.",
    )
    rank_peak_bytes: list[Bytes] | None = Field(
        None,
        max_length=MAX_WORLD_SIZE,
        description="A distributed run's allocated peak per rank (the peaks above: the largest).",
    )


class LeaseCall(Wire):
    """Base of every trial call: the lease token that fences it."""

    lease: str = Field(min_length=16, max_length=128)


class StartRequest(LeaseCall, PlanChoice):
    """The worker chose a plan and starts running."""

    plan: Plan
    prediction: Prediction | None = None
    cards: list[Annotated[int, Field(ge=0, lt=MAX_WORLD_SIZE)]] | None = Field(
        None,
        max_length=MAX_WORLD_SIZE,
        description="Which of a node worker's cards it runs on (indexes into its registered "
        "`cards`), one per rank; None: a one-card worker's card.",
    )

    @model_validator(mode="after")
    def _a_card_per_rank(self) -> StartRequest:
        if self.cards is not None and (
            len(set(self.cards)) != len(self.cards) or len(self.cards) != self.plan.world_size
        ):
            raise ValueError("cards: one distinct card per rank of the plan's world_size")
        return self


class ReportRequest(LeaseCall):
    """An intermediate value at a step."""

    step: int = Field(ge=0, le=10**9)
    value: Finite


class ReportReply(Wire):
    """Whether the study's pruner prunes the trial now."""

    prune: bool


class StepTimeObservation(Wire):
    """What decides a run's time per optimizer step, and what it measured
    (vramtune.service.step_time)."""

    batch_size: int = Field(ge=1, le=10**7, description="The effective batch (samples a step).")
    micro_batch: int = Field(ge=1, le=10**7, description="Samples per micro-batch.")
    micro_batches: int = Field(ge=1, le=10**7, description="Micro-batches per step.")
    checkpointing: bool = False
    checkpointed_fraction: Finite | None = Field(
        None, ge=0, le=1, description="Share of blocks checkpointed; None: all (when on)."
    )
    chunked_loss: bool = False
    bf16: bool = False
    # Left out when off, as in Plan: an observation without offload reads as before.
    activation_offload: bool = offload_field(ACTIVATION_OFFLOAD)
    optimizer_offload: bool = offload_field(OPTIMIZER_OFFLOAD)
    parameter_bytes: Bytes = Field(0, description="The model's parameters (its size).")
    as_asked_peak_bytes: Bytes = Field(0, description="Predicted footprint as asked (its work).")
    # Left out for one card, as in Plan: a one-card observation reads as before issue 31.
    world_size: int = world_size_field(
        "Ranks it ran on; the micro-batch fields are one rank's share."
    )
    strategy: Strategy | None = strategy_field()
    reshard_after_forward: bool = reshard_field(
        "FSDP2: False when it kept gathered parameters through backward."
    )
    # Left out when None, as in Plan: an observation of the task's optimizer reads as before.
    optimizer: PlanOptimizer | None = Field(
        None,
        description="The optimizer the plan swapped in (adamw_8bit, adafactor); None: the task's.",
        exclude_if=lambda optimizer: optimizer is None,
    )
    predicted_step_s: Finite | None = Field(None, ge=0, description="The model's prediction.")
    measured_step_s: Finite | None = Field(None, ge=0, description="Training time / steps.")


MAX_STEP_TIME_TERMS = 32
"""The most step-time coefficients a fit may carry: room for terms later versions add."""


class StepTimeFit(Wire):
    """The step-time model of one (card model, task), fitted by vramtune.service.step_time."""

    card_model: str
    task: str
    overhead_samples: float = Field(description="A micro-batch's fixed cost, in samples.")
    # 6 before chunked_loss had a term, 7 before the world size and FSDP had theirs (issue 31),
    # 9 before the offload rungs had theirs, 11 before FSDP kept gathered, 12 before the
    # optimizer rungs had theirs: such a fit reads the rest from the prior. Up to
    # MAX_STEP_TIME_TERMS: a newer server's terms that this worker does not know are ignored
    # (common.step_time.coefficients_of), not refused, so a server upgraded before its workers
    # keeps serving them its fit.
    coefficients: list[float] = Field(min_length=6, max_length=MAX_STEP_TIME_TERMS)
    n_observations: int = 0
    median_error: float | None = Field(None, description="In-sample |pred - meas| / meas.")


class CompleteRequest(LeaseCall):
    """The trial finished: its value(s) and what it used."""

    values: list[Finite] = Field(min_length=1, max_length=3)
    plan: Plan
    prediction: Prediction | None = None
    measured: Measured
    duration_s: Finite = Field(ge=0)
    samples_per_s: Finite | None = Field(None, ge=0)
    step_time: StepTimeObservation | None = None
    next: NextRequest | None = Field(
        None,
        description="Also ask for the worker's next trial, as POST /workers/ID/next would: "
        "the reply's `next` holds the assignment (null when there is no work, or when it "
        "could not be leased: `next_detail` says why). Saves a request per trial.",
    )


FailKind = Literal["oom", "error", "interrupted", "pruned"]


class FailRequest(LeaseCall):
    """The trial could not finish (or was pruned)."""

    kind: FailKind
    message: ShortText = ""
    plan: Plan | None = None
    prediction: Prediction | None = None
    measured: Measured | None = None


class RankNeed(Wire):
    """What a distributed trial needs at one world size: cards, and bytes on each."""

    world_size: int = Field(ge=2, le=MAX_WORLD_SIZE)
    strategy: Strategy
    per_rank_bytes: Bytes


class HandBackRequest(LeaseCall, PlanChoice):
    """The trial does not fit this card even at its smallest footprint."""

    min_footprint_bytes: Bytes
    plan: Plan | None = Field(None, description="The smallest plan the worker could reach.")
    reason: ShortText = ""
    fits_here: bool = Field(
        False,
        description="It fits this card resized, handed back for a larger card that runs it "
        "faster: re-offered, never ended infeasible, when no such card is live.",
    )
    rank_needs: list[RankNeed] | None = Field(
        None,
        max_length=MAX_WORLD_SIZE,
        description="For a study with `distributed`: the per-rank bytes the trial needs at "
        "each world size the worker predicted; the server routes it to a node with that many "
        "free cards of that size, fewest ranks first.",
    )


TrialResolution = Literal[
    "started", "complete", "failed", "retry", "waiting", "infeasible", "pruned"
]


class TrialAck(Wire):
    """What became of the trial after a start, complete, fail or hand-back."""

    trial_id: int
    resolution: TrialResolution
    detail: str = ""


class CompleteReply(TrialAck):
    """A complete's answer; with the worker's next trial when the request asked for one."""

    next: Assignment | None = None
    next_detail: str = ""


class WorkerOut(Wire):
    """A worker as the fleet page shows it."""

    id: int
    name: str
    device: str
    card: CardInfo
    tasks: list[str]
    state: Literal["live", "stale", "stopped"]
    last_heartbeat: UtcDatetime
    current_trials: list[int]
    trials_done: int


class WorkerList(Wire):
    """A page of the fleet, live workers first (then stale, then stopped; by id within)."""

    workers: list[WorkerOut]
    total: int = Field(description="Workers matching the query, on every page.")
    offset: int
    limit: int


class Calibration(Wire):
    """Correction for one (card model, torch version, task): predicted' = scale·p + offset."""

    card_model: str
    torch_version: str
    task: str
    scale: float = 1.0
    offset_bytes: int = 0
    margin_fraction: float = Field(0.05, description="Extra headroom the fit says is needed.")
    n_observations: int = 0


class ErrorOut(BaseModel):
    """Every error body: {"detail": ...}."""

    detail: str | list[dict[str, Any]]


# ---------------------------------------------------------------- tokens (security issue)


TokenScope = Literal["admin", "submit", "worker", "read"]


# A lifetime such as 30d, 12h, 90m or 3600s: at most 999999 of a unit (about 2,700 years).
Duration = Annotated[str, Field(pattern=r"^[1-9][0-9]{0,5}[smhd]$", examples=["30d", "12h"])]


class TokenCreate(Wire):
    """A new API token: its scopes and, optionally, the only studies it may touch."""

    name: Name
    scopes: list[TokenScope] = Field(min_length=1, max_length=4)
    studies: list[Name] | None = Field(
        None, min_length=1, max_length=1024, description="Limit to these studies; null: all."
    )
    expires_in: Duration | None = Field(
        None, description="Lifetime from now: a number and s, m, h or d (30d); null: never."
    )


class TokenOut(Wire):
    """A token as listed: never the token itself, which is stored only as a hash."""

    id: int
    name: str
    scopes: list[TokenScope]
    studies: list[str] | None
    created_at: UtcDatetime
    revoked_at: UtcDatetime | None = None
    last_used_at: UtcDatetime | None = None
    expires_at: UtcDatetime | None = None


class TokenCreated(TokenOut):
    """A token just created, with the token in clear: shown this once."""

    token: str = Field(description="Send as 'Authorization: Bearer <token>'; not shown again.")


class TokenList(Wire):
    """Every token, revoked ones included."""

    tokens: list[TokenOut]


class AuditOut(Wire):
    """One audit event: what was done, by which token (its name), to what."""

    id: int
    at: UtcDatetime
    event: str
    actor: str = Field(description="The acting token's name; cli:USER for the command line.")
    token_id: int | None
    target: str
    detail: dict[str, Any]


class AuditPage(Wire):
    """Audit events, newest first; ask again with before=<last id> for older ones."""

    events: list[AuditOut]


class WhoAmI(Wire):
    """The caller as the server sees it."""

    name: str
    scopes: list[TokenScope]
    studies: list[str] | None = Field(description="The only studies it may touch; null: all.")
