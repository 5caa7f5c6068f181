"""A worker's first plan choice beside its later ones, before and after a change (issue 35).

Reads two runs of bench/demo_run.py (their ``demo_run.json``: the workers' `started` and
`handed_back` events, each with its `planning_s`) and writes ``first_plan.{md,json}``: per run,
each worker's first plan choice, the median of the later ones, and the load they ran at.

    flock /tmp/bench.lock .venv/bin/python bench/demo_run.py --out /tmp/before
    ... change the code ...
    flock /tmp/bench.lock .venv/bin/python bench/demo_run.py --out /tmp/after
    .venv/bin/python bench/first_plan.py --before /tmp/before/demo_run.json \\
        --after /tmp/after/demo_run.json --label-before "..." --label-after "..."

Wall-clock `planning_s` on a loaded machine mostly measures the load, so the report also plays
the same plan choices in two fresh processes (the demo's configurations, in trial order, on its
256 MiB card), one cold and one that warms up first as the worker now does, and gives each
choice's wall and CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import write_report  # noqa: E402

RESULTS = REPO / "bench" / "results"


def first_and_later(choices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per worker: its first plan choice's seconds, and the later ones' (in the logs' order)."""
    by_worker: dict[str, list[float]] = {}
    for choice in choices:  # demo_run sorts them by time
        by_worker.setdefault(choice["worker"], []).append(choice["planning_s"])
    return {
        worker: {
            "first_s": seconds[0],
            "later_s": seconds[1:],
            "later_median_s": statistics.median(seconds[1:]) if seconds[1:] else None,
        }
        for worker, seconds in sorted(by_worker.items())
    }


def summary(label: str, run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: its commit, load and each worker's first and later choices."""
    return {
        "label": label,
        "commit": run["commit"],
        "when": run["when"],
        "load_1min_before": run["run"]["load_before"][0],
        "load_1min_after": run["run"]["load_after"][0],
        "wall_s": run["run"]["wall_s"],
        "returncode": run["run"]["returncode"],
        "workers": first_and_later(run["choices"]),
    }


def play_choices(configs: list[dict[str, Any]], warm: bool) -> dict[str, Any]:
    """In this process: (warm-up if asked, then) one plan choice per demo configuration."""
    import yaml

    from vramtune.service.wire import StudyCreate
    from vramtune.worker.device.gpu import parse_size, simulated_card
    from vramtune.worker.plan.policy import choose_plan
    from vramtune.worker.predictor import warm_up
    from vramtune.worker.tasks.registry import discover
    from vramtune.worker.tasks.warm import warm_up_workloads
    from vramtune.worker.trial.runner import CardSpec, trial_config

    spec = StudyCreate.model_validate(
        yaml.safe_load((REPO / "examples" / "char-transformer.yaml").read_text())
    )
    runner = discover(["vramtune.worker.tasks.charlm"], entry_points=False).runners[spec.task]
    card = CardSpec(info=simulated_card(parse_size("256MiB")))
    timed: dict[str, Any] = {"warm_up": None, "choices": []}
    if warm:
        timed["warm_up"] = _timed(lambda: warm_up(warm_up_workloads()))
    free = card.info.free_bytes
    for config in [trial_config(spec.task_config, params) for params in configs]:
        choose = partial(choose_plan, runner, config, spec.memory_policy, card, free)
        timed["choices"].append(_timed(choose))
    return timed


def _timed(work: Any) -> dict[str, float]:
    """Wall and CPU seconds of work()."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def in_fresh_processes(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """play_choices in a cold and in a warmed fresh process, with the load around each."""
    played = {}
    for mode in ("cold", "warm"):
        load = os.getloadavg()[0]
        command = [sys.executable, __file__, "--child", mode]
        done = subprocess.run(
            command, input=json.dumps(configs), capture_output=True, text=True, check=True
        )
        played[mode] = json.loads(done.stdout.splitlines()[-1])
        played[mode]["load_1min_before"], played[mode]["load_1min_after"] = load, os.getloadavg()[0]
    return played


def markdown(runs: list[dict[str, Any]]) -> str:
    """The report: one row per run and worker."""
    lines = [
        "# A worker's first plan choice vs its later ones (`vramtune demo --trials 6`)",
        "",
        "`planning_s` of the workers' `started` / `handed_back` events (bench/demo_run.py), "
        "2 CPUs shared with other work; the load is the 1-minute load average before and "
        "after each run. Written by `bench/first_plan.py`.",
        "",
        "| run | commit | load (before / after) | worker | first plan choice | later ones: "
        "median (all) |",
        "|---|---|---|---|---:|---|",
    ]
    for run in runs:
        load = f"{run['load_1min_before']:.2f} / {run['load_1min_after']:.2f}"
        for worker, figures in run["workers"].items():
            later = figures["later_s"]
            shown = (
                f"{figures['later_median_s']:.2f} s ({', '.join(f'{s:.2f}' for s in later)})"
                if later
                else "-"
            )
            lines.append(
                f"| {run['label']} | {run['commit']} | {load} | {worker} | "
                f"{figures['first_s']:.2f} s | {shown} |"
            )
    return "\n".join(lines) + "\n"


def markdown_played(played: dict[str, Any]) -> str:
    """The cold and warmed processes' plan choices, wall and CPU seconds."""
    lines = [
        "",
        "## The same plan choices in a fresh process, cold and warmed up",
        "",
        "The demo run's configurations in trial order, `choose_plan` on a simulated 256 MiB card "
        "(`bench/first_plan.py --child`), each process new: *cold* takes its first choice with "
        "nothing traced yet (a worker before issue 35, whose first lease came before its warm-up "
        "ended); *warm* runs the worker's warm-up first (`vramtune.worker.tasks.warm`), as a "
        "worker now does before its first lease.",
        "",
        "| process | load (before / after) | warm-up | choice 1 | later choices: median | "
        "each (wall / CPU s) |",
        "|---|---|---|---:|---:|---|",
    ]
    for mode, timed in played.items():
        choices = timed["choices"]
        warm = timed["warm_up"]
        shown_warm = "-" if warm is None else f"{warm['wall_s']:.2f} s ({warm['cpu_s']:.2f} CPU)"
        first = f"{choices[0]['wall_s']:.2f} s ({choices[0]['cpu_s']:.2f} CPU)"
        later = statistics.median(c["wall_s"] for c in choices[1:])
        later_cpu = statistics.median(c["cpu_s"] for c in choices[1:])
        each = ", ".join(f"{c['wall_s']:.2f}/{c['cpu_s']:.2f}" for c in choices)
        lines.append(
            f"| {mode} | {timed['load_1min_before']:.2f} / {timed['load_1min_after']:.2f} | "
            f"{shown_warm} | {first} | {later:.2f} s ({later_cpu:.2f} CPU) | {each} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Read the two runs and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="demo_run.json, before")
    parser.add_argument("--after", type=Path, help="demo_run.json, after")
    parser.add_argument("--child", choices=("cold", "warm"), help=argparse.SUPPRESS)
    parser.add_argument("--label-before", default="before")
    parser.add_argument("--label-after", default="after")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.child:  # one fresh process of in_fresh_processes: configurations in, times out
        print(json.dumps(play_choices(json.loads(sys.stdin.read()), args.child == "warm")))
        return
    if args.before is None or args.after is None:
        parser.error("--before and --after are required")
    before = json.loads(args.before.read_text())
    runs = [
        summary(args.label_before, before),
        summary(args.label_after, json.loads(args.after.read_text())),
    ]
    played = in_fresh_processes([t["params"] for t in before["trials"]])
    report = markdown(runs) + markdown_played(played)
    write_report(args.out, "first_plan", {"runs": runs, "fresh_processes": played}, report)


if __name__ == "__main__":
    main()
