"""`vramtune demo --trials N`, run as a new user would, measured: wall time, each trial's plan
choice (`planning_s` from the workers' logs and the trial record), and the outcomes shown.

Targets (issue 14 section 3): the 6-trial demo within 3 minutes on this machine, showing
resized, routed and infeasible trials; the plan choice <= 2 s median.

Writes ``demo_run.{md,json}`` under ``--out`` (default bench/results/).

    flock -x /tmp/vramtune-bench.lock .venv/bin/python bench/demo_run.py [--trials 6]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import optuna

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import write_report  # noqa: E402

RESULTS = REPO / "bench" / "results"
TARGET_S = 180.0
# The workers' log events that end a plan choice (each with its `planning_s`).
CHOICES = ("started", "handed_back")


def run_demo(trials: int, workdir: Path) -> dict[str, Any]:
    """Run the demo to its end; its command, wall and CPU seconds, output and load."""
    command = [
        sys.executable,
        "-m",
        "vramtune",
        "demo",
        "--trials",
        str(trials),
        "--port",
        "0",
        "--database",
        str(workdir / "demo.db"),
        "--log-dir",
        str(workdir / "logs"),
    ]
    load_before = os.getloadavg()
    began, children = time.perf_counter(), os.times()
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1200)
    wall = time.perf_counter() - began
    after = os.times()
    return {
        "command": "vramtune " + shlex.join(command[3:]),
        "returncode": done.returncode,
        "wall_s": wall,
        "cpu_s": (after.children_user - children.children_user)
        + (after.children_system - children.children_system),
        "stdout": done.stdout,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }


def plan_choices(log_dir: Path) -> list[dict[str, Any]]:
    """Every plan choice the workers logged (JSON lines: `started`, `handed_back`), in order."""
    choices = []
    for log in sorted(log_dir.glob("worker-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line that is not an event (a library's own print)
            if isinstance(event, dict) and event.get("event") in CHOICES:
                choices.append(
                    {
                        "worker": log.stem.removeprefix("worker-"),
                        "event": event["event"],
                        "number": event.get("number"),
                        "planning_s": float(event.get("planning_s", 0.0)),
                        "time": event.get("time", ""),
                    }
                )
    return sorted(choices, key=lambda c: c["time"])


def trial_rows(database: Path) -> list[dict[str, Any]]:
    """Each trial of the demo's study: its shape, state, outcome and recorded plan choice."""
    storage = f"sqlite:///{database}"
    [summary] = optuna.study.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    rows = []
    for trial in study.trials:
        attrs = trial.user_attrs
        rows.append(
            {
                "number": trial.number,
                "params": trial.params,
                "state": trial.state.name,
                "outcome": attrs.get("vramtune.outcome"),
                "plan": (attrs.get("vramtune.plan") or {}),
                "worker": attrs.get("vramtune.worker"),
                "planning_s": attrs.get("vramtune.planning_s"),
            }
        )
    return rows


def commit() -> str:
    """The checkout's commit, marked when the tree has changes."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return head + (" (with uncommitted changes)" if dirty else "")


def markdown(result: dict[str, Any]) -> str:
    """The report."""
    run, choices, trials = result["run"], result["choices"], result["trials"]
    seconds = [c["planning_s"] for c in choices]
    outcomes = Counter(t["outcome"] for t in trials if t["outcome"])
    median = statistics.median(seconds) if seconds else float("nan")
    shown = {kind: outcomes[kind] for kind in ("resized", "routed", "infeasible")}
    lines = [
        f"# `vramtune demo --trials {result['trials_asked']}`, tried as a new user would",
        "",
        f"{result['when']} · commit {result['commit']} · {os.cpu_count()} CPUs · load average "
        f"{run['load_before'][0]:.2f} before, {run['load_after'][0]:.2f} after (1 min) · "
        "`python bench/demo_run.py`, under the exclusive benchmark lock",
        "",
        f"Command: `{run['command']}` (exit {run['returncode']}).",
        "",
        "| | this run | target |",
        "|---|---|---|",
        f"| whole demo | **{run['wall_s']:.0f} s** wall ({run['cpu_s']:.0f} s CPU of its processes)"
        f" | <= {TARGET_S:.0f} s: {_verdict(run['wall_s'], TARGET_S)} |",
        f"| plan choice (`planning_s`, {len(seconds)} choices in the workers' logs) | median "
        f"**{median:.2f} s**, max {max(seconds, default=0):.2f} s | <= 2 s median: "
        f"{_verdict(median, 2.0)} |",
        f"| outcomes shown | {_counts(outcomes)} | resized, routed and infeasible: "
        f"{'met' if all(shown.values()) else 'missed'} |",
        "",
        "## Plan choices (worker logs, in order)",
        "",
        "| worker | trial # | event | planning_s |",
        "|---|---:|---|---:|",
    ]
    lines += [
        f"| {c['worker']} | {c['number']} | {c['event']} | {c['planning_s']:.2f} |" for c in choices
    ]
    lines += [
        "",
        "## Trials (the study's records)",
        "",
        "| # | layers x width, heads, seq, batch | state | outcome | worker | plan | planning_s |",
        "|---:|---|---|---|---|---|---:|",
    ]
    for t in trials:
        p = t["params"]
        shape = (
            f"{p.get('n_layers')} x {p.get('d_model')}, h{p.get('n_heads')}, "
            f"{p.get('seq_len')}, B{p.get('batch_size')}"
        )
        plan = t["plan"].get("reason", "").split(":")[0] or "-"
        planning = "-" if t["planning_s"] is None else f"{t['planning_s']:.2f}"
        lines.append(
            f"| {t['number']} | {shape} | {t['state']} | {t['outcome'] or '-'} | "
            f"{t['worker'] or '-'} | {plan} | {planning} |"
        )
    lines += ["", "## Last progress lines", "", "```"]
    lines += [line for line in run["stdout"].splitlines() if line.startswith("trials")][-3:]
    lines += ["```", ""]
    return "\n".join(lines)


def _verdict(measured: float, target: float) -> str:
    if measured <= target:
        return "met"
    return f"missed by {measured - target:.1f} s ({measured / target:.2f}x)"


def _counts(outcomes: Counter[str]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(outcomes.items())) or "none"


def main() -> None:
    """Run the demo and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", type=Path, help="where the demo's database and logs stay")
    parser.add_argument(
        "--reread", type=Path, help="a run's demo_run.json: report its workdir again, not run"
    )
    args = parser.parse_args()
    result: dict[str, Any]
    if args.reread:
        result = json.loads(args.reread.read_text())
        workdir = Path(result["workdir"])
    else:
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vramtune-demo-"))
        result = {
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "commit": commit(),
            "trials_asked": args.trials,
            "workdir": str(workdir),
            "run": run_demo(args.trials, workdir),
        }
        print(result["run"]["stdout"], f"\ndatabase and logs: {workdir}", flush=True)
    result["choices"] = plan_choices(workdir / "logs")
    result["trials"] = trial_rows(workdir / "demo.db")
    write_report(args.out, "demo_run", result, markdown(result))


if __name__ == "__main__":
    main()
