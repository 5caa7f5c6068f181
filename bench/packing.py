"""Packing small trials on one card (issue 15, section 3): completed trials per hour, packed
against the one-trial-per-card worker, on real torch training.

Each arm gets a fresh SQLite database, a real server (``python -m vramtune serve``) and one real
worker process (``python -m vramtune worker --device cpu --memory-limit 512MiB``) that runs a
digits-cnn study of small configurations: the same random sampler and seed, hence the same
configuration for each trial number in every arm (the server keeps a seeded sampler's state).
The clock starts when the study is created (the worker is registered and idle, a packing
worker's slot processes started) and stops when
its last trial is finished; trials per hour is trials over that time. Arms:

- ``one``: ``--max-trials-per-card 1``, one trial at a time in the worker's process, torch's
  default thread count (every core);
- ``packed-N``: ``--max-trials-per-card N``; the study allows packing; each trial runs in a slot
  process with cores // N torch threads (at least one).

This machine has no GPU: the "card" is simulated, and packed trials share the CPU's cores, so
what packing wins here is what one small trial leaves of two cores idle (single-threaded Python
per step, evaluation, the plan choice, REST calls), not a GPU's idle SMs. Reported beside each
figure: the load average before and after, and the worker's CPU seconds (its slot processes'
included) per completed trial.

    flock -x /tmp/vramtune-bench.lock .venv/bin/python bench/packing.py            # ~8 min
    flock -x /tmp/vramtune-bench.lock .venv/bin/python bench/packing.py --trials 6 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vramtune.service.client import Client
from vramtune.service.testing import server_factory, sqlite_url, upgrade_database
from vramtune.service.wire import TrialOut

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
CARD = "512MiB"
FINISHED = {"COMPLETE", "FAIL", "PRUNED"}


def _choices(*values: Any) -> dict[str, Any]:
    return {"type": "categorical", "choices": list(values)}


# Small digits CNNs: predicted peaks of 1-20 MiB, a few seconds of CPU each.
SPACE = {
    "width": _choices(4, 8, 16),
    "depth": _choices(1, 2),
    "resolution": _choices(8, 12),
    "batch_size": _choices(16, 32, 64),
    "lr": _choices(0.003, 0.01, 0.03),
}


def study_body(name: str, trials: int, steps: int) -> dict[str, Any]:
    """The study every arm runs (packing allowed: the one-trial worker ignores it)."""
    return {
        "name": name,
        "task": "digits-cnn",
        "search_space": SPACE,
        "directions": ["maximize"],
        "sampler": {"name": "random", "args": {"seed": 0}},
        "pruner": {"name": "none"},
        "n_trials": trials,
        "budget": {"max_steps": steps, "eval_every": steps},
        "memory_policy": {"allow_packing": True},
    }


def slots_of(arm: str) -> int:
    """one -> 1, packed-N -> N."""
    return 1 if arm == "one" else int(arm.removeprefix("packed-"))


def run_arm(arm: str, trials: int, steps: int, directory: Path) -> dict[str, Any]:
    """One arm on a fresh server and database: throughput, CPU, OOMs and the metrics."""
    url = upgrade_database(sqlite_url(directory))
    load_before = os.getloadavg()
    with server_factory(directory) as start_server:
        server = start_server(url)
        log_path = directory / f"worker-{arm}.log"
        worker = _start_worker(server.url, slots_of(arm), log_path)
        try:
            # Ready: registered, and a packing worker's slot processes have imported torch.
            ready = "registered" if slots_of(arm) == 1 else "slots_ready"
            _wait_for(log_path, f'"event": "{ready}"', worker)
            usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
            with Client(server.url) as client:
                began = time.monotonic()
                client.create_study(study_body(f"packing-{arm}", trials, steps))
                done = _wait_finished(client, f"packing-{arm}", trials, worker)
                elapsed = time.monotonic() - began
            worker.terminate()
            worker.wait(60)
            usage_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        finally:
            if worker.poll() is None:
                worker.kill()
    load_after = os.getloadavg()
    cpu = (usage_after.ru_utime - usage_before.ru_utime) + (
        usage_after.ru_stime - usage_before.ru_stime
    )
    return _summary(arm, done, elapsed, cpu, log_path, load_before, load_after)


def _start_worker(server: str, slots: int, log_path: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "vramtune", "worker", "--server", server, "--device", "cpu"]
    command += ["--memory-limit", CARD, "--poll", "0.1", "--name", log_path.stem]
    command += ["--max-trials-per-card", str(slots)]
    with log_path.open("ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def _wait_for(log_path: Path, text: str, worker: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while text not in log_path.read_text(errors="replace"):
        if worker.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the worker never logged {text!r}:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)


def _wait_finished(
    client: Client, study: str, trials: int, worker: subprocess.Popen[bytes]
) -> list[TrialOut]:
    while True:
        found = list(client.trials(study, limit=1000).trials)
        if len(found) >= trials and all(
            t.state in FINISHED and t.outcome is not None for t in found
        ):
            return found
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited with {worker.returncode}")
        time.sleep(0.2)


def _summary(
    arm: str,
    trials: list[TrialOut],
    elapsed: float,
    cpu: float,
    log_path: Path,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> dict[str, Any]:
    completed = [t for t in trials if t.state == "COMPLETE"]
    values = {t.number: t.values[0] for t in completed if t.values}
    events = [json.loads(line) for line in log_path.read_text().splitlines() if line[:1] == "{"]
    return {
        "arm": arm,
        "slots": slots_of(arm),
        "trials": len(trials),
        "completed": len(completed),
        "failed": sum(t.state == "FAIL" for t in trials),
        "oom_trials": sum(t.outcome == "oom" or t.attempt > 0 for t in trials),
        "oom_events": sum(e.get("event") == "failed" and e.get("kind") == "oom" for e in events),
        "packed_runs": sum(e.get("event") == "started" and bool(e.get("packed")) for e in events),
        "elapsed_s": round(elapsed, 2),
        "trials_per_hour": round(len(completed) / elapsed * 3600, 1),
        "worker_cpu_s": round(cpu, 2),
        "cpu_s_per_trial": round(cpu / max(len(completed), 1), 3),
        "best": max(values.values(), default=None),
        "quartiles": _quartiles(list(values.values())),
        "values_by_number": values,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
    }


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return values
    return [round(q, 4) for q in statistics.quantiles(values, n=4)]


def compare(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """Each packed arm against the one-trial worker: speed-up and metric differences."""
    base = next((a for a in arms if a["arm"] == "one"), None)
    if base is None:
        return {}
    out: dict[str, Any] = {}
    for arm in arms:
        if arm is base:
            continue
        same = set(arm["values_by_number"]) & set(base["values_by_number"])
        diffs = [abs(arm["values_by_number"][n] - base["values_by_number"][n]) for n in same]
        out[arm["arm"]] = {
            "speedup": round(arm["trials_per_hour"] / base["trials_per_hour"], 3),
            "cpu_per_trial_ratio": round(arm["cpu_s_per_trial"] / base["cpu_s_per_trial"], 3),
            "same_trials": len(same),
            "max_abs_metric_diff": round(max(diffs, default=0.0), 4),
            "mean_abs_metric_diff": round(statistics.fmean(diffs), 4) if diffs else 0.0,
        }
    return out


def write(report: dict[str, Any], stem: str) -> None:
    """bench/results/<stem>.json and .md."""
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Packing small trials on one card",
        "",
        f"Command: `{report['command']}`  ",
        *([f"Code: {report['commit']}  "] if report.get("commit") else []),
        f"Machine: {os.cpu_count()} CPU cores, no GPU; simulated {CARD} card; task digits-cnn, "
        f"{report['trials']} trials of {report['steps']} steps, random sampler (seed 0).",
        "",
        "| arm | trials/hour | elapsed s | completed | OOM trials | packed runs | worker CPU-s "
        "per trial | cores busy | CPU-bound ceiling, trials/hour | best | quartiles | "
        "load before → after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cores = report.get("cores", os.cpu_count() or 1)
    for arm in report["arms"]:
        busy = arm["worker_cpu_s"] / arm["elapsed_s"]
        ceiling = cores / arm["cpu_s_per_trial"] * 3600
        lines.append(
            f"| {arm['arm']} | {arm['trials_per_hour']} | {arm['elapsed_s']} | "
            f"{arm['completed']}/{arm['trials']} | {arm['oom_trials']} | {arm['packed_runs']} | "
            f"{arm['cpu_s_per_trial']} | {busy:.2f} of {cores} | {ceiling:.0f} | "
            f"{round(arm['best'], 4)} | {arm['quartiles']} | "
            f"{arm['load_before'][0]} → {arm['load_after'][0]} |"
        )
    lines += [
        "",
        "| packed arm | speed-up vs one | CPU-s per trial ratio | max abs metric diff, "
        "same trial number | mean abs diff |",
        "|---|---|---|---|---|",
    ]
    for name, row in report["compare"].items():
        lines.append(
            f"| {name} | {row['speedup']}x | {row['cpu_per_trial_ratio']} | "
            f"{row['max_abs_metric_diff']} ({row['same_trials']} trials) | "
            f"{row['mean_abs_metric_diff']} |"
        )
    lines += [
        "",
        "Cores busy: the worker's CPU-seconds (its slot processes' included) over the elapsed "
        "time; the CPU-seconds include each process's start (imports, before the clock), so a "
        "packed arm, with more processes, can show more busy cores than the machine has, and "
        "its CPU-seconds per trial are slightly overstated. CPU-bound ceiling: every core busy "
        "at the arm's CPU-seconds per trial, the most "
        "any packing could reach on this machine; the one-trial worker already keeps most of "
        "the cores busy (torch runs a step on every core), so on a CPU packing can win only "
        "the cores it leaves idle and what a one-thread process saves per trial (no threads "
        "spinning between small ops). On a GPU the card is the resource the small trials leave "
        "idle, and the CPU is not the limit.",
    ]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--arms", default="one,packed-2")
    parser.add_argument("--out", default="packing", help="results file stem in bench/results")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args()
    if args.render:
        write(json.loads((RESULTS / f"{args.out}.json").read_text()), args.out)
        return
    arms = []
    for arm in args.arms.split(","):
        with tempfile.TemporaryDirectory(prefix=f"packing-{arm}-") as directory:
            result = run_arm(arm, args.trials, args.steps, Path(directory))
        print(json.dumps({k: v for k, v in result.items() if k != "values_by_number"}))
        arms.append(result)
    report = {
        "command": "flock -x /tmp/vramtune-bench.lock .venv/bin/python bench/packing.py "
        + " ".join(sys.argv[1:]),
        "trials": args.trials,
        "steps": args.steps,
        "cores": os.cpu_count(),
        "arms": arms,
        "compare": compare(arms),
    }
    print(json.dumps(report["compare"]))
    write(report, args.out)


if __name__ == "__main__":
    main()
