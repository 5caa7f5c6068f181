"""Response bodies of the dashboard's JSON endpoints: columnar, small, ready to plot."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from vramtune.service.wire import ObjectiveValue, ParamValue, PlanOut

DashboardState = Literal["running", "paused", "done", "idle"]
WorkerState = Literal["live", "stale", "lost", "stopped"]


class MemoryCounts(BaseModel):
    """A vramtune study's trials by what memory did to them."""

    resized: int = Field(0, description="Completed smaller: micro-batch, checkpointing or bf16.")
    routed: int = Field(
        0, description="Ran on a larger card after a hand-back (completed, pruned or failed there)."
    )
    routed_pruned: int = Field(0, description="Of the routed ones, those pruned there.")
    infeasible: int = Field(0, description="Fit no card of the fleet.")
    oom: int = Field(0, description="Ran out of memory at least once (retried or failed).")


class StudyListItem(BaseModel):
    """One study as the studies page lists it."""

    id: int
    name: str
    task: str | None = Field(description="None for a plain Optuna study in the same database.")
    state: DashboardState
    directions: list[str]
    n_trials: int | None = Field(description="The trial budget (None for a plain Optuna study).")
    counts: dict[str, int] = Field(description="Trials by Optuna TrialState name.")
    memory: MemoryCounts | None = Field(description="None for a plain Optuna study.")
    finished: int
    running: int
    best_value: ObjectiveValue | None
    trials_per_hour: float | None = Field(
        description="Finished trials per hour over the last hour of activity."
    )
    created_at: datetime | None
    last_activity: datetime | None


class StudyListOut(BaseModel):
    """Every study in the database."""

    studies: list[StudyListItem]
    now: datetime


class ParamInfo(BaseModel):
    """A parameter of the study's search space as its trials record it."""

    name: str
    kind: Literal["float", "int", "categorical"]
    log: bool = False
    low: float | None = None
    high: float | None = None
    choices: list[ParamValue] | None = None


class BestTrial(BaseModel):
    """The best completed trial of a single-objective study."""

    number: int
    values: list[ObjectiveValue]
    params: dict[str, ParamValue]


class StudyOverview(BaseModel):
    """The study page's header; ``revision`` changes whenever any plot would."""

    id: int
    name: str
    task: str | None
    state: DashboardState
    directions: list[str]
    objective_names: list[str]
    n_trials: int | None
    counts: dict[str, int]
    finished: int
    running: int
    infeasible: int = Field(description="Completed trials that violate a constraint.")
    best: BestTrial | None
    params: list[ParamInfo]
    card_models: list[str]
    minimize_peak_memory: bool
    trials_per_hour: float | None
    revision: str
    now: datetime


class History(BaseModel):
    """Completed trials' objective by trial number, downsampled; the best line is exact."""

    objective: int
    direction: str
    total: int = Field(description="Completed trials with a finite value.")
    numbers: list[int]
    values: list[float]
    best_numbers: list[int]
    best_values: list[float]
    downsampled: bool


class MemoryScatter(BaseModel):
    """Objective against measured peak memory, with the exact Pareto front."""

    objective: int
    direction: str
    total: int
    numbers: list[int]
    values: list[float]
    measured_bytes: list[int]
    card_models: list[str]
    outcomes: list[str]
    front_numbers: list[int]
    front_values: list[float]
    front_bytes: list[int]
    downsampled: bool


class ParetoScatter(BaseModel):
    """Two objectives of a study against each other, with the exact front of those two."""

    x_objective: int
    y_objective: int
    x_direction: str
    y_direction: str
    total: int = Field(description="Completed feasible trials with both values finite.")
    numbers: list[int]
    x: list[float]
    y: list[float]
    front_numbers: list[int] = Field(description="No other trial is better on both, by x.")
    front_x: list[float]
    front_y: list[float]
    downsampled: bool


class CardCalibration(BaseModel):
    """Predicted against measured peaks of every run on one card model."""

    card_model: str
    n: int = Field(description="Runs with a prediction: the sample the figures are of.")
    median_bias: float | None = Field(
        description="Median of measured/predicted - 1: above 0, runs used more than predicted."
    )
    median_abs_error: float | None = Field(description="Median of |measured/predicted - 1|.")
    p95_abs_error: float | None
    under_fraction: float | None = Field(description="Share of runs that used more than predicted.")
    numbers: list[int]
    predicted_bytes: list[int]
    measured_bytes: list[int]
    outcomes: list[str]


class Calibration(BaseModel):
    """The calibration picture of a study, one card model at a time."""

    cards: list[CardCalibration]
    target_under_fraction: float = Field(
        description="The share of runs the calibration served to workers lets exceed its "
        "corrected prediction plus margin."
    )
    downsampled: bool


class RegionCategory(BaseModel):
    """Trials of one outcome in the plane of two parameters."""

    name: str
    count: int
    numbers: list[int]
    x: list[ParamValue]
    y: list[ParamValue]
    pruned: list[bool] = Field(description="Whether each trial was pruned (drawn as a shape).")


class Regions(BaseModel):
    """Where in the plane of two parameters trials ran as asked, resized, OOMed or did not fit."""

    x: str
    y: str
    total: int
    categories: list[RegionCategory]
    downsampled: bool


class Importance(BaseModel):
    """One parameter's importance."""

    name: str
    importance: float


class Importances(BaseModel):
    """Optuna's own parameter importances over a bounded sample of completed trials."""

    objective: int
    evaluator: str
    n_complete: int = Field(description="Completed feasible trials.")
    n_used: int
    importances: list[Importance]
    note: str | None = Field(None, description="Why there are none, when there are none.")
    caveat: str | None = Field(None, description="Why to doubt them, when there are few trials.")
    computed_at: datetime


class TrialRowOut(BaseModel):
    """One row of the trial table."""

    id: int
    number: int
    state: str
    values: list[ObjectiveValue] | None
    feasible: bool = Field(
        description="False when a constraint is violated: values are placeholders."
    )
    params: dict[str, ParamValue]
    outcome: str | None = Field(description="The last outcome stored (what the filter matches).")
    told_outcome: str | None = Field(
        None,
        description="The most informative outcome: how it ran and how it ended when they differ "
        "('routed, pruned'); vramtune.common.plans.told_outcome.",
    )
    waiting: bool = Field(False, description="Waits for a worker (pending or handed back).")
    planning_since: datetime | None = Field(
        None, description="While its worker chooses the plan (leased, not started): when leased."
    )
    note: str | None = Field(
        None, description="Why a trial that waits is not running (no live worker offers the task)."
    )
    attempt: int
    plan: PlanOut | None
    plan_words: str | None = Field(
        None, description="The plan's rungs in words (vramtune.common.plans.plan_in_words)."
    )
    predicted_bytes: int | None
    measured_bytes: int | None
    worker: str | None
    card_model: str | None
    datetime_start: datetime | None
    datetime_complete: datetime | None
    duration_s: float | None


class TrialTable(BaseModel):
    """A sorted, filtered page of the trial table, with the filters' choices."""

    total: int = Field(description="Trials matching the filters.")
    offset: int
    limit: int
    sort: str
    order: Literal["asc", "desc"]
    rows: list[TrialRowOut]
    workers: list[str]
    outcomes: list[str]
    note: str | None = Field(
        None,
        description="Why the study's trials wait, when they do (no live worker offers its task).",
    )


class Observation(BaseModel):
    """One run of a trial: predicted and measured peaks."""

    card_model: str
    outcome: str
    plan: PlanOut | None
    predicted_allocated: int | None
    measured_allocated: int
    measured_reserved: int | None
    created_at: datetime


class TrialEvent(BaseModel):
    """One thing that happened to a trial, as the call that made it happen recorded it."""

    at: datetime
    kind: str = Field(description="leased, routed, planned, resized, handed_back, oom, pruned...")
    text: str = Field(description="The event in words, bytes in human units.")
    detail: dict[str, Any]


class TrialDetail(TrialRowOut):
    """One trial in full: its intermediate curve, message, attempts' plans and runs."""

    intermediate_steps: list[int]
    intermediate_values: list[ObjectiveValue]
    intermediate_total: int
    message: str | None
    plans_tried: list[PlanOut]
    planning_s: float | None = Field(None, description="Seconds the worker took to choose a plan.")
    prediction_source: str | None = Field(
        None, description="Where the plan's predictions came from: fleet, worker or mixed."
    )
    user_attrs: dict[str, Any]
    rank_peak_bytes: list[int] | None = Field(
        None, description="A distributed run's measured peak on each rank, rank 0 first."
    )
    observations: list[Observation]
    events: list[TrialEvent] = Field(
        default_factory=list, description="The trial's story, oldest first."
    )


class AdviceItem(BaseModel):
    """One piece of advice: what the trials and the fleet show, and what would change it."""

    kind: Literal["infeasible", "calibration", "no_worker", "missed_oom"]
    title: str
    text: str
    actions: list[str] = Field(description="Changes that would help, the likeliest first.")
    trials: list[int] = Field(default_factory=list, description="Trial numbers it is about.")
    footprint_bytes: int | None = Field(
        None, description="Infeasible: the closest configuration's smallest footprint."
    )
    largest_card_bytes: int | None = Field(
        None, description="Infeasible: the largest card of the fleet for the task."
    )


class Advice(BaseModel):
    """A study's "what to do next", computed from its trials and the fleet."""

    items: list[AdviceItem]


class CurrentTrial(BaseModel):
    """A trial a worker holds a lease on."""

    study: str | None
    number: int | None
    trial_id: int
    attempt: int
    world_size: int = Field(
        1, description="Cards it runs on: its plan's world size (1 until a plan is started)."
    )


class FleetWorker(BaseModel):
    """One worker and its card."""

    id: int
    name: str
    device: str
    card_model: str
    simulated: bool
    total_bytes: int = Field(description="One card's bytes (each card's, on a node worker).")
    free_bytes: int
    cards: int = Field(1, description="Cards it runs trials on: above 1 for a node worker.")
    busy_cards: int = Field(0, description="Cards its current trials use (their world sizes).")
    tasks: list[str]
    state: WorkerState
    last_heartbeat: datetime
    heartbeat_age_s: float
    registered_at: datetime
    current: list[CurrentTrial]
    trials_run: int = Field(
        description="Trials it was leased and did not hand back: run, running, or lost mid-run."
    )
    trials_done: int = Field(description="Trials it completed.")


class FleetTotals(BaseModel):
    """The fleet at a glance (memory counts live workers only)."""

    workers: dict[str, int] = Field(description="Workers by state.")
    total_bytes: int
    free_bytes: int
    running_trials: int
    card_models: dict[str, int] = Field(description="Live workers by card model.")


class Fleet(BaseModel):
    """A page of workers, live first, the totals of every worker, how staleness is judged."""

    workers: list[FleetWorker]
    totals: FleetTotals
    total: int  # workers on every page
    offset: int
    limit: int
    stale_after_s: float
    lost_after_s: float
    now: datetime
