"""The cost of the step-time fit before and after it weighs workers and drops outliers
(issue 30, item 2), on the same 2,000 observations, side by side in one run.

"Before" is service/step_time.py as it was at BEFORE (read with `git show`): one ridge fit per
overhead on the grid, every run weighing 1. "After" is the current fit: each worker's runs
weigh alike, runs more than 2x off the re-centred fit dropped, the rest fitted again. Two sets
of 2,000 runs of a simulated card (a micro-batch costs 32 samples, checkpointing 1.6x, 3 %
noise; 5 workers):

- honest: 5 workers x 400 runs (nothing is dropped: "after" makes one fit);
- poisoned: 4 honest workers x 450 runs and one reporting 200 runs 10^4 times slower (the
  attack of issue 30; "after" drops them and fits again).

For each, CPU seconds per fit (`time.process_time`, median of REPEATS) and the median
relative error of the fit on 200 fresh honest runs.

Usage: ``flock /tmp/bench.lock .venv/bin/python bench/step_time_fit.py [--out bench/results]``.
Writes step_time_fit.json and .md, with the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vramtune.service.step_time import fit_step_time, relative_error  # noqa: E402
from vramtune.service.wire import StepTimeFit, StepTimeObservation  # noqa: E402

BEFORE = "b2d3dbc"  # the last commit before the step-time fit weighed workers
REPEATS = 5
N_RUNS = 2000
Fit = Callable[[Sequence[StepTimeObservation], Sequence[int]], StepTimeFit]


def load_average() -> float:
    """The 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def fit_before() -> Fit:
    """The fit as it was at BEFORE, every run weighing 1 (the workers are ignored)."""
    source = subprocess.run(
        ["git", "show", f"{BEFORE}:vramtune/service/step_time.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType("step_time_before")
    exec(compile(source, "step_time_before.py", "exec"), module.__dict__)
    old = module.fit_step_time
    return lambda runs, _workers: old("card", "task", runs)


def fit_after(runs: Sequence[StepTimeObservation], workers: Sequence[int]) -> StepTimeFit:
    """The current fit, told who reported each run."""
    return fit_step_time("card", "task", runs, workers)


def simulated(rng: random.Random, slowdown: float = 1.0) -> StepTimeObservation:
    """One run of a card where a micro-batch costs 32 samples, 1 ms a sample, checkpointing
    1.6x, work ~ sqrt(peak), 3 % noise; ``slowdown`` times slower as reported."""
    batch = rng.choice([16, 32, 64, 128, 256])
    micro = rng.choice([batch, max(1, batch // 4), max(1, batch // 16)])
    checkpointing = rng.random() < 0.3
    peak = rng.choice([10**7, 10**8, 10**9])
    n = math.ceil(batch / micro)
    seconds = 1e-3 * n * (micro + 32.0) * (peak / 1e8) ** 0.5 * (1.6 if checkpointing else 1.0)
    return StepTimeObservation(
        batch_size=batch,
        micro_batch=micro,
        micro_batches=n,
        checkpointing=checkpointing,
        parameter_bytes=10**6,
        as_asked_peak_bytes=peak,
        measured_step_s=seconds * slowdown * math.exp(rng.gauss(0, 0.03)),
    )


def observations(poisoned: bool, seed: int = 0) -> tuple[list[StepTimeObservation], list[int]]:
    """N_RUNS runs and their workers: 5 honest workers, or 4 and one 10^4 times slower."""
    rng = random.Random(seed)
    honest = 4 if poisoned else 5
    per_worker = (N_RUNS - 200) // honest if poisoned else N_RUNS // honest
    workers = [w for w in range(honest) for _ in range(per_worker)]
    runs = [simulated(rng) for _ in workers]
    if poisoned:
        runs += [simulated(rng, slowdown=1e4) for _ in range(200)]
        workers += [honest] * 200
    return runs, workers


def measure(fit: Fit, runs: list[StepTimeObservation], workers: list[int]) -> dict[str, Any]:
    """CPU seconds per fit (median of REPEATS, and each), the fit's runs and its error."""
    seconds, made = [], None
    for _ in range(REPEATS):
        start = time.process_time()
        made = fit(runs, workers)
        seconds.append(time.process_time() - start)
    assert made is not None
    fresh = [simulated(random.Random(10_000 + i)) for i in range(200)]
    return {
        "cpu_s_per_fit": statistics.median(seconds),
        "cpu_s_each": seconds,
        "n_observations": made.n_observations,
        "median_error_on_fresh": statistics.median(relative_error(made, x) for x in fresh),
    }


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    lines = [
        "# Step-time fit: cost before and after the worker weights and outlier drop",
        "",
        f"{result['date']}, `bench/step_time_fit.py`, {N_RUNS} observations, "
        f"median of {REPEATS} fits; before = `vramtune/service/step_time.py` at {BEFORE}. "
        f"Load average (1 min) {result['load_before']:.2f} before, "
        f"{result['load_after']:.2f} after.",
        "",
        "| set | fit | CPU s per fit | runs fitted | median error on 200 fresh honest runs |",
        "|---|---|---|---|---|",
    ]
    for name, arms in result["sets"].items():
        for arm, row in arms.items():
            lines.append(
                f"| {name} | {arm} | {row['cpu_s_per_fit']:.3f} | {row['n_observations']} | "
                f"{100 * row['median_error_on_fresh']:.1f} % |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_before": load_average(),
        "sets": {},
    }
    before = fit_before()
    for name, poisoned in (("honest", False), ("poisoned", True)):
        runs, workers = observations(poisoned)
        result["sets"][name] = {
            "before": measure(before, runs, workers),
            "after": measure(fit_after, runs, workers),
        }
        print(name, json.dumps(result["sets"][name]), flush=True)
    result["load_after"] = load_average()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_time_fit.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "step_time_fit.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
