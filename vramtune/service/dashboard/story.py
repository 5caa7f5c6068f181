"""A trial's story (vramtune.service.fleet.events) in words: the trial view's timeline."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from vramtune.common.plans import plan_in_words, stored_plan
from vramtune.common.units import human_bytes, infeasible_reason
from vramtune.service.dashboard import schema
from vramtune.service.dashboard.models import TrialEvent
from vramtune.service.db.tables import TrialEventRow

MAX_EVENTS = 200  # a trial's story is short; a pathological one is cut, oldest kept


def trial_events(session: Session, trial_id: int, since: datetime | None) -> list[TrialEvent]:
    """The trial's events, oldest first. SQLite reuses a deleted trial's id: only those since
    the trial began are this trial's (as its observations)."""
    E = TrialEventRow
    query = select(E).where(E.trial_id == trial_id).order_by(E.id).limit(MAX_EVENTS)
    if since is not None:
        query = query.where(E.at >= since)
    return [
        TrialEvent(
            at=schema.utc(e.at), kind=e.kind, text=event_text(e.kind, e.detail), detail=e.detail
        )
        for e in session.scalars(query)
    ]


def event_text(kind: str, detail: Mapping[str, Any]) -> str:
    """One event in words, bytes in human units."""
    words = _WORDS.get(kind)
    return words(detail) if words else kind.replace("_", " ")


def _card(detail: Mapping[str, Any]) -> str:
    worker = detail.get("worker") or "a worker"
    card = detail.get("card_bytes")
    return f"{worker} ({human_bytes(card)})" if card else str(worker)


def plan_words(plan: Mapping[str, Any] | None) -> str:
    """A stored plan in the table's words (vramtune.common.plans.plan_in_words: its ranks and
    strategy when above one card, then its rungs); "as asked" without one."""
    if not plan:
        return "as asked"
    return plan_in_words(stored_plan(plan)) or "as asked"


def _planned(detail: Mapping[str, Any]) -> str:
    predicted = detail.get("predicted_bytes")
    at = f", predicted {human_bytes(predicted)}" if predicted else ""
    cards = detail.get("cards")  # which of a node's cards
    on = f", card{'s' if len(cards) > 1 else ''} {', '.join(map(str, cards))}" if cards else ""
    return f"runs {plan_words(detail.get('plan'))} on {_card(detail)}{on}{at}"


def _handed_back(detail: Mapping[str, Any]) -> str:
    needs = human_bytes(detail.get("footprint_bytes"))
    then = {
        "waits": "waits for a larger card",
        "here": "no larger card is live: offered again where it fits",
    }.get(str(detail.get("then")), "")
    return f"handed back by {_card(detail)}: needs {needs} at its smallest plan; {then}".rstrip(
        "; "
    )


def _oom(detail: Mapping[str, Any]) -> str:
    measured = detail.get("measured_bytes")
    at = f" at {human_bytes(measured)}" if measured else ""
    return (
        f"out of memory{at} on {_card(detail)} running {plan_words(detail.get('plan'))}; "
        f"{detail.get('then', '')}"
    ).rstrip("; ")


def _completed(detail: Mapping[str, Any]) -> str:
    outcome = str(detail.get("outcome") or "").replace("_", " ")
    measured, predicted = detail.get("measured_bytes"), detail.get("predicted_bytes")
    peaks = f": measured {human_bytes(measured)}" if measured else ""
    if measured and predicted:
        peaks += f" against {human_bytes(predicted)} predicted"
    return f"completed {outcome} on {_card(detail)}{peaks}".replace("  ", " ")


def _pruned(detail: Mapping[str, Any]) -> str:
    step, message = detail.get("step"), detail.get("message")
    if step is not None:
        return f"pruned at step {step} on {_card(detail)}"
    return f"pruned on {_card(detail)}" + (f": {message}" if message else "")


def _infeasible(detail: Mapping[str, Any]) -> str:
    footprint, largest, margin = (
        detail.get("footprint_bytes"),
        detail.get("largest_card_bytes"),
        detail.get("margin"),
    )
    if isinstance(footprint, int) and isinstance(largest, int) and isinstance(margin, int | float):
        return f"infeasible: {infeasible_reason(footprint, largest, margin)}"
    # An event stored before the margin was (issue 43).
    return (
        f"infeasible: needs {human_bytes(footprint)}; the largest live card has "
        f"{human_bytes(largest)}"
    )


_WORDS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "leased": lambda d: f"leased to {_card(d)} (attempt {d.get('attempt', 0)})",
    "routed": lambda d: f"routed to the larger card of {_card(d)}",
    "planned": _planned,
    "resized": lambda d: f"resized: {_planned(d)}",
    "handed_back": _handed_back,
    "infeasible": _infeasible,
    "oom": _oom,
    "interrupted": lambda d: f"interrupted on {_card(d)}; offered again",
    "lease_lost": lambda d: (
        f"lease lost: {d.get('worker')} stopped heartbeating; "
        + ("offered again" if d.get("then") == "offered" else "failed")
    ),
    "pruned": _pruned,
    "completed": _completed,
    "failed": lambda d: f"failed on {_card(d)}: {d.get('message', '')}".rstrip(": "),
}
