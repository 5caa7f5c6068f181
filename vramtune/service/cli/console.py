"""How the command line prints: aligned tables, JSON for scripts, the server's errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from pydantic import BaseModel

from vramtune.common.plans import plan_in_words
from vramtune.service.client import ApiError
from vramtune.service.wire import StudySummary, TrialOut


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Rows under their headers in aligned columns (None prints as an empty cell)."""
    cells = [[str(h) for h in headers], *[["" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def emit_json(value: BaseModel | list[BaseModel]) -> None:
    """Print a wire model (or a list of them) as indented JSON, for scripts."""
    if isinstance(value, list):
        print(json.dumps([v.model_dump(mode="json") for v in value], indent=2))
    else:
        print(value.model_dump_json(indent=2))


def finished(summary: StudySummary) -> int:
    """Trials of the study that ended: complete, pruned or failed."""
    return sum(summary.counts.get(s, 0) for s in ("COMPLETE", "PRUNED", "FAIL"))


def study_rows(studies: Sequence[StudySummary]) -> str:
    """The `study list` table."""
    headers = ["NAME", "TASK", "STATE", "TRIALS", "RUNNING", "BEST"]
    rows = [
        [
            s.name,
            s.task,
            s.state,
            f"{finished(s)}/{s.n_trials}",
            s.counts.get("RUNNING", 0),
            s.best_value,
        ]
        for s in studies
    ]
    return table(headers, rows)


def trial_rows(trials: Sequence[TrialOut]) -> str:
    """The `study trials` and `study best` table."""
    headers = ["NUMBER", "STATE", "VALUES", "ATTEMPT", "OUTCOME", "PLAN", "WORKER", "RANKS"]
    headers += ["PEAK/RANK", "PARAMS"]
    rows = [
        [
            t.number,
            t.state,
            t.values,
            t.attempt,
            t.told_outcome or t.outcome,
            plan_in_words(t.plan),
            t.worker,
            ranks_cell(t),
            peak_cell(t),
            json.dumps(t.params),
        ]
        for t in trials
    ]
    return table(headers, rows)


def ranks_cell(trial: TrialOut) -> str | None:
    """'2 fsdp' for a distributed run ('2 fsdp gathered': FSDP2 keeping its parameters gathered
    after forward), '1' for one card, empty before a plan."""
    plan = trial.plan
    if plan is None:
        return None
    if plan.strategy is None:
        return str(plan.world_size)
    gathered = "" if plan.reshard_after_forward else " gathered"
    return f"{plan.world_size} {plan.strategy}{gathered}"


def peak_cell(trial: TrialOut) -> str | None:
    """Predicted → measured peak, per rank ('p → m1/m2' for each rank of a distributed run)."""
    if trial.predicted_peak_bytes is None and trial.measured_peak_bytes is None:
        return None
    measured: Sequence[int | None] = trial.rank_peak_bytes or [trial.measured_peak_bytes]
    shown = "/".join("?" if peak is None else str(peak) for peak in measured)
    return f"{trial.predicted_peak_bytes or '?'} -> {shown}"


def show_study(summary: StudySummary) -> str:
    """`study show`: one study, a field a line."""
    spec = summary.spec
    lines = [
        f"study      {summary.name} (id {summary.id})",
        f"task       {summary.task}",
        f"state      {summary.state}",
        f"directions {', '.join(summary.directions)}",
        f"sampler    {spec.sampler.name} {json.dumps(spec.sampler.args)}",
        f"pruner     {spec.pruner.name} {json.dumps(spec.pruner.args)}",
        f"trials     {finished(summary)}/{summary.n_trials} finished",
        "counts     " + ", ".join(f"{k}={v}" for k, v in summary.counts.items()),
        f"best       {summary.best_value}",
        "space",
    ]
    lines += [f"  {name}: {p.model_dump_json()}" for name, p in spec.search_space.items()]
    lines += [f"warning    {warning}" for warning in summary.warnings]
    return "\n".join(lines)


def print_api_error(exc: ApiError) -> None:
    """The server's refusal on stderr: one line per invalid field, else its detail."""
    if isinstance(exc.detail, list):
        for error in exc.detail:
            loc = ".".join(str(part) for part in error.get("loc", []) if part != "body")
            print(f"vramtune: {loc}: {error.get('msg')}", file=sys.stderr)
    else:
        print(f"vramtune: {exc.detail} (HTTP {exc.status})", file=sys.stderr)
