"""What the study page's advice and trial story cost at 10,000 trials (bounded SQL, #35).

Seeds the database bench/dashboard_scale.py seeds (one study of N finished trials, a share of
them infeasible, resized or OOMed, with memory observations), serves it with `vramtune serve`
and times, cold (first request after the start) and warm, the endpoints this work added or
changed: the advice, the trial table (its told outcome and the no-worker note) and one trial
with its story. Each figure is written with the 1-minute load average beside it.

    flock /tmp/bench.lock .venv/bin/python bench/advice_scale.py [--trials 10000]

Writes bench/results/advice_scale.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.dashboard_scale import STUDY, seed, vramtune_server  # noqa: E402

PATHS = (
    "/advice",
    "/trials?sort=number&order=desc&limit=50",
    "/trials/42",
)
REPEATS = 5


def load_average() -> float:
    """The 1-minute load average, written beside every figure."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def time_path(client: httpx.Client, url: str) -> dict[str, float]:
    """Seconds of the first request, the fastest of the warm ones, and the load meanwhile."""
    timings = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        client.get(url).raise_for_status()
        timings.append(time.perf_counter() - began)
    return {"first_s": timings[0], "warm_s": min(timings[1:]), "load": load_average()}


def measure(n_trials: int) -> list[tuple[str, dict[str, float]]]:
    """Seed, serve, and time each path on the fresh server."""
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'scale.db'}"
        seed(url, n_trials, random.Random(7))
        with vramtune_server(url, Path(tmp) / "serve.log") as base, httpx.Client(timeout=120) as c:
            prefix = f"{base}/api/v1/dashboard/studies/{STUDY}"
            return [(path, time_path(c, prefix + path)) for path in PATHS]


def markdown(n_trials: int, rows: list[tuple[str, dict[str, float]]]) -> str:
    """The results table."""
    lines = [
        f"# Advice and trial story at {n_trials:,} trials (SQLite, `vramtune serve`)",
        "",
        "Produced by `bench/advice_scale.py`; first request after a fresh start, then the",
        f"fastest of {REPEATS - 1} warm ones; load = 1-minute load average after the requests.",
        "",
        "| endpoint | first (s) | warm (s) | load |",
        "|---|---|---|---|",
    ]
    for path, t in rows:
        lines.append(f"| `{path}` | {t['first_s']:.3f} | {t['warm_s']:.3f} | {t['load']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the measurement and write bench/results/advice_scale.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10_000)
    args = parser.parse_args()
    text = markdown(args.trials, measure(args.trials))
    (REPO / "bench" / "results" / "advice_scale.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
