"""A study's "what to do next": advice computed from its trials and the fleet, in bounded SQL.

Each piece reads at most a fixed number of rows (the closest infeasible trials, the latest
observations, the latest feasible trials), never the whole study: a 10,000-trial study's page
costs what a 100-trial one does. The parts that depend only on the study's trials are kept
per revision (service.dashboard.cache); whether a live worker offers the study's task is read
on every visit (workers come and go without the study changing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from vramtune.common.plans import RUNG_WORDS
from vramtune.common.units import human_bytes, percent
from vramtune.service.dashboard import cache, schema, series
from vramtune.service.dashboard.models import Advice, AdviceItem
from vramtune.service.dashboard.studies_view import StudyFacts, study_facts, study_space
from vramtune.service.db.tables import MemoryObservationRow, StudyRow, TrialRow
from vramtune.service.fleet.offers import live_tasks, task_warnings, usable_rungs
from vramtune.service.fleet.routing import live_capacity
from vramtune.service.optuna.glue import spec_of
from vramtune.service.settings import Settings
from vramtune.service.studies import study_state
from vramtune.service.wire import MemoryPolicy, Resize

CLOSEST_INFEASIBLE = 50  # infeasible trials read, smallest footprint first
FEASIBLE_SAMPLE = 2000  # latest feasible trials read to find the parameter that drives memory
OBSERVATION_SAMPLE = 2000  # latest completed runs read for the calibration's bias
MISSED_OOM_SAMPLE = 20  # latest OOMs shown
MIN_RUNS = 3  # fewer completed runs say nothing about a bias
BIAS_THRESHOLD = 0.10  # a median bias beyond ±10 % is worth acting on
ADDITIVE_SPREAD = 2.0  # excess bytes within this factor across sizes: an additive overhead
FEASIBLE_OUTCOMES = ("as_asked", "resized", "routed", "pruned")  # they ran: they fit a card


def advice(session: Session, name: str, settings: Settings, now: datetime) -> Advice:
    """What to do next for the named study: the settled advice, then the fleet's."""
    facts = study_facts(session, name, counted=True)
    if facts.row is None:  # a plain Optuna study: vramtune knows nothing of its memory
        return Advice(items=[])
    row = facts.row
    settled = cache.by_revision(
        session, facts.study_id, "advice", lambda: _settled(session, facts, row)
    )
    # A done study needs no worker: its trials were all told.
    done = study_state(row, facts.counts) == "done"
    fleet = [] if done else _no_worker(session, row, settings, now)
    infeasible = [_with_cards(item, session, row, settings, now) for item in settled]
    return Advice(items=[*fleet, *infeasible])


def _settled(session: Session, facts: StudyFacts, row: StudyRow) -> list[AdviceItem]:
    """The advice that depends on the study's trials only."""
    items = [
        _infeasible(session, facts, row),
        *_calibration(session, row),
        _missed_ooms(session, row),
    ]
    return [item for item in items if item is not None]


# ---------------------------------------------------------------- no worker for the task


def _no_worker(
    session: Session, row: StudyRow, settings: Settings, now: datetime
) -> list[AdviceItem]:
    """The study waits for a worker that offers its task, when no live one does."""
    if row.paused:
        return []
    return [
        AdviceItem(
            kind="no_worker",
            title=f"No live worker offers task {row.task!r}",
            text=warning,
            actions=[
                f"start a worker that has the task: vramtune worker --tasks <module> "
                f"(its registration must list {row.task!r})",
                "or check the study's task name for a typo",
            ],
        )
        for warning in task_warnings(row.task, live_tasks(session, now, settings.worker_stale_s))
    ]


def no_worker_note(
    session: Session, row: StudyRow | None, settings: Settings, now: datetime
) -> str | None:
    """The trial table's note for trials that wait: no live worker offers the study's task."""
    if row is None:
        return None
    if row.task in live_tasks(session, now, settings.worker_stale_s):
        return None
    return f"no live worker offers task {row.task!r}"


# ---------------------------------------------------------------- infeasible


def _infeasible(session: Session, facts: StudyFacts, row: StudyRow) -> AdviceItem | None:
    """The infeasible trials, closest first, with the changes that would make them fit."""
    count = session.scalar(
        select(func.count()).where(
            TrialRow.study_id == row.study_id, TrialRow.outcome == "infeasible"
        )
    )
    if not count:
        return None
    closest = list(
        session.execute(
            select(TrialRow.number, TrialRow.min_bytes, TrialRow.params)
            .where(TrialRow.study_id == row.study_id, TrialRow.outcome == "infeasible")
            .order_by(TrialRow.min_bytes, TrialRow.number)
            .limit(CLOSEST_INFEASIBLE)
        )
    )
    number, footprint, _ = closest[0]
    # The rungs to allow are added live (`_with_cards`): which ones a worker can use changes
    # with the fleet, not with the study's revision.
    actions = [_bound(session, facts, row, [p or {} for _, _, p in closest])]
    return AdviceItem(
        kind="infeasible",
        title=f"{count} configuration{'s' if count != 1 else ''} fit no card of the fleet",
        text=f"The closest, trial #{number}, needs {human_bytes(footprint)} at its smallest plan.",
        actions=[a for a in actions if a],
        trials=[n for n, _, _ in closest[:10]],
        footprint_bytes=int(footprint),
    )


def _with_cards(
    item: AdviceItem, session: Session, row: StudyRow, settings: Settings, now: datetime
) -> AdviceItem:
    """An infeasible advice with the rungs the fleet could use, the fleet's largest card and
    how far off it is (read live)."""
    if item.kind != "infeasible" or item.footprint_bytes is None:
        return item
    policy = spec_of(row).memory_policy
    rungs = usable_rungs(session, row.task, now, settings.worker_stale_s)
    item = item.model_copy(update={"actions": [*_rungs(policy, rungs), *item.actions]})
    needed = item.footprint_bytes
    assert needed is not None  # checked above; model_copy keeps it
    largest = _largest_card(session, row, settings, now)
    if largest <= 0:
        return item
    # Short of what the card leaves after the safety margin: a footprint below the card's
    # size but above that reads "-24.5 MiB short" against the card alone (issue 43).
    margin = f"{policy.margin:.0%}"
    usable = max(int(largest * (1.0 - policy.margin)), 1)
    short = needed - usable
    card = int(needed / (1 - policy.margin)) if policy.margin < 1 else needed
    text = (
        f"{item.text} The largest live card has {human_bytes(largest)}, "
        f"{human_bytes(usable)} usable after the {margin} safety margin: "
        f"{human_bytes(short)} short ({percent(short / usable)})."
    )
    larger = f"add a card of at least {human_bytes(card)} (its footprint and the {margin} margin)"
    return item.model_copy(
        update={"text": text, "largest_card_bytes": largest, "actions": [*item.actions, larger]}
    )


def _largest_card(session: Session, study: StudyRow, settings: Settings, now: datetime) -> int:
    """The largest live card that may lease the study's trials; else the largest registered
    lately that may: routing's cards (routing.live_cards), as routing believes their size."""
    bound = settings.max_card_bytes
    live = live_capacity(session, study, now, settings.worker_stale_s, bound)
    return live if live > 0 else live_capacity(session, study, now, None, bound)


RUNG_ADVICE: dict[Resize, str] = {
    "micro_batch": "allow smaller micro-batches with accumulation",
    "checkpointing": "allow activation checkpointing",
    "chunked_cross_entropy": "allow the loss over the vocabulary in chunks (language models)",
    "activation_offload": "allow the saved activations in host memory (CUDA cards, slower)",
    "optimizer_offload": "allow the optimizer's state in host memory (CUDA cards, slower)",
    "bf16": "allow bf16 autocast (about half the activations; changes the numerics)",
    "adamw_8bit": "allow 8-bit AdamW state (a quarter of AdamW's; changes the numerics)",
    "adafactor": "allow Adafactor (factored optimizer state; changes the numerics)",
}
"""Each rung an infeasible trial's advice may suggest, in the ladder's order, in words."""


def _rungs(policy: MemoryPolicy, usable: set[str] | None = None) -> list[str]:
    """The rungs the study's memory policy leaves out, each one that may make them fit
    (checkpointing counts as listed when selective checkpointing is), and only those some
    worker can use for the study's task on its card (`usable`, as the workers registered
    them; None: unknown, every rung): a rung no worker can take would change nothing."""
    offered = [
        resize
        for resize in RUNG_ADVICE
        if usable is None
        or resize in usable
        or (resize == "checkpointing" and "selective_checkpointing" in usable)
    ]
    if not policy.allow_resize:
        if not offered:
            return []
        named = ", ".join(RUNG_WORDS[r] for r in offered[:2])
        return [f"allow resizing: memory_policy.allow_resize: true ({named})"]
    listed = set(policy.resizes)
    if "selective_checkpointing" in listed:
        listed.add("checkpointing")
    return [
        f"{RUNG_ADVICE[resize]}: add '{resize}' to memory_policy.resizes"
        for resize in offered
        if resize not in listed
    ]


def _bound(
    session: Session, facts: StudyFacts, row: StudyRow, infeasible: Sequence[dict[str, Any]]
) -> str | None:
    """A search-space bound that would leave the infeasible configurations out: the parameter
    whose every infeasible value is above every feasible one (the one that drives memory)."""
    feasible = [
        params or {}
        for params in session.scalars(
            select(TrialRow.params)
            .where(TrialRow.study_id == row.study_id, TrialRow.outcome.in_(FEASIBLE_OUTCOMES))
            .order_by(TrialRow.trial_id.desc())
            .limit(FEASIBLE_SAMPLE)
        )
    ]
    if not feasible:
        return None
    for name, distribution in study_space(session, facts).items():
        split = _split(name, feasible, infeasible)
        if split is not None:
            return _bound_text(name, distribution, *split)
    return None


def _split(
    name: str, feasible: Sequence[dict[str, Any]], infeasible: Sequence[dict[str, Any]]
) -> tuple[float, float] | None:
    """(largest feasible, smallest infeasible) value of a numeric parameter that separates them."""
    fits = [v for p in feasible if (v := _number(p.get(name))) is not None]
    fails = [v for p in infeasible if (v := _number(p.get(name))) is not None]
    if not fits or len(fails) < len(infeasible) or max(fits) >= min(fails):
        return None
    return max(fits), min(fails)


def _number(value: object) -> float | None:
    """A numeric parameter value as a float; None for a string, a bool or nothing."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _bound_text(name: str, distribution: BaseDistribution, fits: float, fails: float) -> str:
    """How to bound the parameter in the study file."""
    shown = f"{fits:g}"
    if isinstance(distribution, CategoricalDistribution):
        dropped = [c for c in distribution.choices if (_number(c) or float("-inf")) >= fails]
        listed = ", ".join(str(c) for c in dropped)
        return (
            f"'{name}' drives memory (every infeasible trial has {name} >= {fails:g}, every "
            f"feasible one <= {shown}): drop {listed} from search_space.{name}.choices"
        )
    if isinstance(distribution, FloatDistribution | IntDistribution):
        return (
            f"'{name}' drives memory (every infeasible trial has {name} >= {fails:g}, every "
            f"feasible one <= {shown}): lower search_space.{name}.high from "
            f"{distribution.high:g} to {shown}"
        )
    return f"'{name}' drives memory: keep it at most {shown}"


# ---------------------------------------------------------------- calibration


@dataclass(frozen=True)
class _Run:
    predicted: int
    measured: int


def _calibration(session: Session, row: StudyRow) -> list[AdviceItem]:
    """A bias of the predictions per card model, with its likely cause."""
    OBS = MemoryObservationRow
    latest = (
        select(OBS.card_model, OBS.predicted_allocated, OBS.measured_allocated)
        .where(
            OBS.study_id == row.study_id,
            OBS.outcome == "complete",
            OBS.predicted_allocated > 0,
        )
        .order_by(OBS.id.desc())
        .limit(OBSERVATION_SAMPLE)
    )
    by_card: dict[str, list[_Run]] = {}
    for card, predicted, measured in session.execute(latest):
        by_card.setdefault(card, []).append(_Run(int(predicted or 0), int(measured)))
    items = [_bias(cards, runs) for cards, runs in _groups(by_card)]
    return [item for item in items if item is not None]


def _groups(by_card: dict[str, list[_Run]]) -> list[tuple[str, list[_Run]]]:
    """Each card model with enough runs on its own; those with too few, pooled (a small study
    spread over two cards still shows a bias its trials all share)."""
    alone = [(card, runs) for card, runs in sorted(by_card.items()) if len(runs) >= MIN_RUNS]
    few = {card: runs for card, runs in sorted(by_card.items()) if len(runs) < MIN_RUNS}
    if not few:
        return alone
    pooled = [run for runs in few.values() for run in runs]
    return [*alone, (" and ".join(few), pooled)]


def _bias(card: str, runs: list[_Run]) -> AdviceItem | None:
    """Advice on one card model's bias, when it is large enough to act on."""
    if len(runs) < MIN_RUNS:
        return None
    median = series.quantile(sorted(r.measured / r.predicted - 1 for r in runs), 0.5) or 0.0
    if abs(median) < BIAS_THRESHOLD:
        return None
    under = sum(r.measured > r.predicted for r in runs) / len(runs)
    figures = f"median bias {percent(median)}, {under:.0%} under-predicted over {len(runs)} runs"
    if median < 0:
        return AdviceItem(
            kind="calibration",
            title=f"Predictions on {card} are too high ({percent(median)})",
            text=f"Measured peaks are below the predicted ones ({figures}): configurations "
            "were resized or routed that would have fit.",
            actions=["report it as a prediction defect: the task, a plan and both peaks"],
        )
    return _under_predicted(card, runs, median, figures)


def _under_predicted(card: str, runs: list[_Run], median: float, figures: str) -> AdviceItem:
    """Measured above predicted: an additive overhead (evaluation) or a scale (the trace)."""
    ordered = sorted(runs, key=lambda r: r.predicted)
    half = len(ordered) // 2
    small = series.quantile(sorted(r.measured - r.predicted for r in ordered[:half]), 0.5) or 0
    large = series.quantile(sorted(r.measured - r.predicted for r in ordered[half:]), 0.5) or 0
    additive = small > 0 and large > 0 and max(small, large) <= ADDITIVE_SPREAD * min(small, large)
    title = f"Predictions on {card} are too low ({percent(median)})"
    if additive:
        return AdviceItem(
            kind="calibration",
            title=title,
            text=f"{figures}. Measured exceeds predicted by about the same amount whatever the "
            f"configuration's size ({human_bytes(small)} on the smaller, {human_bytes(large)} "
            "on the larger): memory outside the predicted training step, most likely an "
            "evaluation run over the whole held-out set at once (not chunked, so not predicted).",
            actions=[
                "evaluate in batches (chunk the held-out set) in the task's evaluate()",
                "or bound the evaluation in the task, so the plan fits it as well",
            ],
        )
    return AdviceItem(
        kind="calibration",
        title=title,
        text=f"{figures}. Measured grows with the configuration's size faster than predicted: "
        "the trace misses part of the training step on this card.",
        actions=["report it as a prediction defect: the task, a plan and both peaks"],
    )


# ---------------------------------------------------------------- OOMs prediction missed


def _missed_ooms(session: Session, row: StudyRow) -> AdviceItem | None:
    """Runs that ran out of memory on a plan predicted to fit: a prediction defect."""
    OBS = MemoryObservationRow
    where = (OBS.study_id == row.study_id, OBS.outcome == "oom", OBS.predicted_allocated > 0)
    count = session.scalar(select(func.count()).where(*where))
    if not count:
        return None
    T = schema.trials
    latest = list(
        session.execute(
            select(T.c.number, OBS.card_model, OBS.predicted_allocated, OBS.measured_allocated)
            .join(T, T.c.trial_id == OBS.trial_id)
            .where(*where)
            .order_by(OBS.id.desc())
            .limit(MISSED_OOM_SAMPLE)
        )
    )
    number, card, predicted, measured = latest[0]
    return AdviceItem(
        kind="missed_oom",
        title=f"{count} run{'s' if count != 1 else ''} ran out of memory though predicted to fit",
        text=f"Trial #{number} was predicted at {human_bytes(predicted)} on {card} and ran out "
        f"of memory at {human_bytes(measured)}. The prediction missed memory the run used: "
        "a prediction defect (each such trial was retried once on a smaller plan).",
        actions=[
            "report it as a prediction defect: the task, the trial's plan and its observations "
            "(trial view, Runs)",
        ],
        trials=sorted({n for n, *_ in latest}),
    )
