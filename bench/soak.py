"""Soak: does the server's memory stay flat over a long run? (Outside the default test run.)

A real ``vramtune serve`` subprocess on a fresh database; K simulated workers (threads, lean
HTTP) run the whole protocol (next, start, two reports, complete, heartbeats) on a rotation of
studies: each study has ``--study-trials`` trials and is deleted once finished, then the next
one is created, as studies come and go on a long-lived server. A scraper reads ``/metrics``
and a reader lists trials, as Prometheus and the dashboard would. The server's RSS is sampled
every ``--sample-s`` seconds.

Verdict: after a warm-up (the first fifth of the run), the RSS trend (least squares) must stay
under ``--max-growth-mib-per-hour`` and the last sample within ``--max-growth-mib`` of the
median of the first post-warm-up window.

With ``--tracemalloc`` the server runs under ``tracemalloc`` and dumps a snapshot of its Python
heap on SIGUSR1; the soak takes one at the end of the warm-up and more at regular points, and
reports the traced heap over time and the allocation sites that grew most between the first
and the last snapshot: a leak shows there by file and line; RSS that grows while the traced
heap stays flat is the allocator's (arenas, fragmentation, native caches), not Python objects
kept alive. tracemalloc slows the server and adds its own memory to RSS: compare RSS within a
run, not across runs with and without it.

Usage: ``python bench/soak.py --minutes 10 [--tracemalloc]`` (results in
bench/results/soak.{md,json}).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from service_throughput import (
    CARD_BYTES,
    REPO,
    STUDY,
    Cell,
    Http,
    fresh_database,
    register,
    setup_vramtune_study,
    vramtune_server,
)

from vramtune.service.wire import API_PREFIX


@dataclass
class Sample:
    """One RSS sample of the server."""

    t_s: float
    rss_mib: float
    trials: int
    studies: int


@dataclass
class SoakState:
    """Shared by the soak's threads."""

    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    trials: int = 0
    studies: int = 1
    errors: list[str] = field(default_factory=list)
    rotating: bool = False

    def error(self, text: str) -> None:
        """Keep the first errors, count the others."""
        with self.lock:
            self.errors.append(text[:300])


def study_spec(name: str, trials: int, sampler: str) -> dict[str, Any]:
    """A quadratic study of ``trials`` trials with two intermediate reports each."""
    return {
        "name": name,
        "task": "quadratic",
        "search_space": {n: {"type": "float", "low": -10, "high": 10} for n in ("x", "y")},
        "sampler": {"name": sampler},
        "pruner": {"name": "median"},
        "n_trials": trials,
        "budget": {"max_steps": 20, "eval_every": 10},
    }


def worker_loop(port: int, index: int, state: SoakState) -> None:
    """One simulated worker: the whole protocol, a heartbeat every few trials."""
    client = Http(port)
    worker_id = register(client, index)
    done = 0
    while not state.stop.is_set():
        status, assignment = client.post(f"/workers/{worker_id}/next", {"free_bytes": CARD_BYTES})
        if status == 204:
            time.sleep(0.2)
            continue
        if status != 200:
            state.error(f"next {status} {assignment}")
            time.sleep(0.5)
            continue
        run_trial(client, assignment, state)
        done += 1
        if done % 5 == 0:
            client.post(f"/workers/{worker_id}/heartbeat", {"free_bytes": CARD_BYTES})


def run_trial(client: Http, assignment: dict[str, Any], state: SoakState) -> None:
    """start, two reports, complete (or stop early when pruned)."""
    trial_id, lease = assignment["trial_id"], assignment["lease"]
    x, y = assignment["params"]["x"], assignment["params"]["y"]
    value = (x - 2) ** 2 + (y + 1) ** 2
    calls: list[tuple[str, dict[str, Any]]] = [
        ("start", {"lease": lease, "plan": {}}),
        ("report", {"lease": lease, "step": 10, "value": value * 2}),
        ("report", {"lease": lease, "step": 20, "value": value}),
    ]
    for call, body in calls:
        status, reply = client.post(f"/trials/{trial_id}/{call}", body)
        if status != 200:
            state.error(f"{call} {status} {reply}")
            return
        if call == "report" and reply["prune"]:
            client.post(f"/trials/{trial_id}/fail", {"lease": lease, "kind": "pruned"})
            count_trial(state)
            return
    body = {
        "lease": lease,
        "values": [value],
        "plan": {},
        "duration_s": 0.01,
        "measured": {"peak_allocated_bytes": 1 << 20},
    }
    status, reply = client.post(f"/trials/{trial_id}/complete", body)
    if status != 200:
        state.error(f"complete {status} {reply}")
        return
    count_trial(state)


def count_trial(state: SoakState) -> None:
    """One more trial finished."""
    with state.lock:
        state.trials += 1


def rotator_loop(port: int, args: argparse.Namespace, state: SoakState) -> None:
    """Delete each finished study and create the next; read /metrics and trials meanwhile."""
    client = Http(port)
    current = STUDY
    while not state.stop.wait(1.0):
        read(client, "/metrics", raw=True)
        read(client, f"{API_PREFIX}/studies/{current}/trials?limit=100", raw=True)
        summary = read(client, f"{API_PREFIX}/studies/{current}")
        if summary is None or summary.get("state") != "done":
            continue
        client.connection.request("DELETE", f"{API_PREFIX}/studies/{current}")
        response = client.connection.getresponse()
        response.read()
        if response.status != 204:
            state.error(f"delete {current}: {response.status}")
        with state.lock:
            state.studies += 1
            current = f"{STUDY}-{state.studies}"
        status, reply = client.post(
            "/studies", study_spec(current, args.study_trials, args.sampler)
        )
        if status != 201:
            state.error(f"create {current}: {status} {reply}")


def read(client: Http, path: str, raw: bool = False) -> Any:
    """GET a path; its JSON (None on a non-200), or nothing when ``raw``."""
    client.connection.request("GET", path)
    response = client.connection.getresponse()
    data = response.read()
    if raw or response.status != 200:
        return None
    return json.loads(data)


# The server under tracemalloc: ``python WRAPPER PORT`` (service_throughput's
# BENCH_SERVER_SCRIPT), a snapshot written to SOAK_SNAPSHOT_DIR on each SIGUSR1.
TRACED_SERVER = """
import os, runpy, signal, sys, time, tracemalloc
tracemalloc.start(int(os.environ.get("SOAK_TRACE_FRAMES", "8")))
def dump(signum, frame):
    path = os.path.join(os.environ["SOAK_SNAPSHOT_DIR"], f"{time.time_ns()}.snapshot")
    tracemalloc.take_snapshot().dump(path + ".partial")
    os.replace(path + ".partial", path)
signal.signal(signal.SIGUSR1, dump)
sys.argv = ["vramtune", "serve", "--port", sys.argv[1]]
runpy.run_module("service", run_name="__main__", alter_sys=True)
"""


@dataclass
class Tracer:
    """Snapshots of the traced server's Python heap, taken on demand."""

    directory: Path
    taken: list[tuple[float, Path]] = field(default_factory=list)

    def snapshot(self, server: psutil.Process, t_s: float, limit_s: float = 120.0) -> None:
        """SIGUSR1 the server and wait for its snapshot file."""
        before = set(self.directory.glob("*.snapshot"))
        server.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            new = set(self.directory.glob("*.snapshot")) - before
            if new:
                self.taken.append((t_s, new.pop()))
                return
            time.sleep(0.5)
        raise RuntimeError("the server wrote no tracemalloc snapshot")


def sample_loop(
    server: psutil.Process, args: argparse.Namespace, state: SoakState, tracer: Tracer | None
) -> list[Sample]:
    """RSS every ``--sample-s`` seconds until the run's end; heap snapshots at set points."""
    samples = []
    began = time.monotonic()
    end = began + args.minutes * 60
    # After the warm-up (a fifth of the run), then at every further fifth, and at the end.
    marks = [began + args.minutes * 60 * k / 5 for k in (1, 2, 3, 4)]
    while time.monotonic() < end:
        with state.lock:
            trials, studies = state.trials, state.studies
        rss = server.memory_info().rss / 2**20
        samples.append(Sample(round(time.monotonic() - began, 1), round(rss, 1), trials, studies))
        if tracer is not None and marks and time.monotonic() >= marks[0]:
            marks.pop(0)
            tracer.snapshot(server, round(time.monotonic() - began, 1))
        time.sleep(args.sample_s)
    if tracer is not None:
        tracer.snapshot(server, round(time.monotonic() - began, 1))
    return samples


# Frames of the measurement itself, not of the server.
_NOT_THE_SERVER = (tracemalloc.__file__, "<frozen importlib._bootstrap>", "<unknown>")


def heap_report(tracer: Tracer, top: int = 15) -> dict[str, Any]:
    """The traced heap at each snapshot, and the sites that grew most from first to last."""
    filters = [tracemalloc.Filter(False, name) for name in _NOT_THE_SERVER]
    loaded = [
        (t, tracemalloc.Snapshot.load(str(p)).filter_traces(filters)) for t, p in tracer.taken
    ]
    heap = []
    for t, snap in loaded:
        sizes = [trace.size for trace in snap.traces]
        heap.append({"t_s": t, "traced_mib": round(sum(sizes) / 2**20, 2), "blocks": len(sizes)})
    first, last = loaded[0][1], loaded[-1][1]
    grew = [
        {
            "site": f"{diff.traceback[0].filename}:{diff.traceback[0].lineno}",
            "size_diff_kib": round(diff.size_diff / 1024, 1),
            "count_diff": diff.count_diff,
            "size_kib": round(diff.size / 1024, 1),
        }
        for diff in last.compare_to(first, "lineno")[:top]
    ]
    return {"heap": heap, "grew": grew}


def slope_per_hour(samples: list[Sample]) -> float:
    """Least-squares RSS trend in MiB per hour."""
    if len(samples) < 2:
        return 0.0
    xs = [s.t_s for s in samples]
    ys = [s.rss_mib for s in samples]
    return float(statistics.linear_regression(xs, ys).slope * 3600)


def verdict(samples: list[Sample], args: argparse.Namespace) -> dict[str, Any]:
    """Flat or not, after the warm-up."""
    warm = samples[len(samples) // 5 :]
    window = warm[: max(1, len(warm) // 10)]
    baseline = statistics.median(s.rss_mib for s in window)
    growth = warm[-1].rss_mib - baseline
    slope = slope_per_hour(warm)
    flat = growth <= args.max_growth_mib and slope <= args.max_growth_mib_per_hour
    return {
        "flat": flat,
        "baseline_mib": round(baseline, 1),
        "last_mib": warm[-1].rss_mib,
        "peak_mib": max(s.rss_mib for s in samples),
        "growth_mib": round(growth, 1),
        "slope_mib_per_hour": round(slope, 1),
    }


def markdown(result: dict[str, Any]) -> str:
    """The soak's report."""
    v, meta = result["verdict"], result["meta"]
    lines = [
        "# Soak: server memory over a long run",
        "",
        f"Run {meta['date']} on {meta['machine']}: {meta['minutes']} min on {meta['database']}, "
        f"{meta['workers']} simulated workers, {meta['sampler']} sampler, studies of "
        f"{meta['study_trials']} trials rotated (deleted when done). Generated by "
        "`bench/soak.py`; samples in `soak.json`.",
        "",
        f"- trials finished: {result['trials']}, studies: {result['studies']}, "
        f"errors: {len(result['errors'])}",
        f"- server RSS after warm-up: {v['baseline_mib']} MiB → {v['last_mib']} MiB at the end "
        f"(peak {v['peak_mib']} MiB); growth {v['growth_mib']} MiB, trend "
        f"{v['slope_mib_per_hour']} MiB/hour",
        f"- verdict: **{'flat' if v['flat'] else 'NOT flat'}** (limits: "
        f"{meta['max_growth_mib']} MiB, {meta['max_growth_mib_per_hour']} MiB/hour)",
        "",
        "| t (s) | RSS MiB | trials | studies |",
        "|---|---|---|---|",
    ]
    samples = result["samples"]
    step = max(1, len(samples) // 20)
    lines += [
        f"| {s['t_s']} | {s['rss_mib']} | {s['trials']} | {s['studies']} |" for s in samples[::step]
    ]
    heap = result.get("tracemalloc")
    if heap:
        lines += ["", "## Python heap (tracemalloc)", "", "| t (s) | traced MiB | blocks |"]
        lines += ["|---|---|---|"]
        lines += [f"| {h['t_s']} | {h['traced_mib']} | {h['blocks']} |" for h in heap["heap"]]
        lines += ["", "Sites that grew most, first snapshot → last:", ""]
        lines += ["| site | grew KiB | blocks | now KiB |", "|---|---|---|---|"]
        lines += [
            f"| `{g['site']}` | {g['size_diff_kib']} | {g['count_diff']} | {g['size_kib']} |"
            for g in heap["grew"]
        ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The soak: server, workers, rotator, sampler; the result."""
    state = SoakState()
    cell = Cell("vramtune", args.database, args.sampler, 0, args.workers)
    scratch = tempfile.TemporaryDirectory(prefix="vramtune-soak-")
    tracer = None
    if args.tracemalloc:
        tracer = Tracer(Path(scratch.name))
        wrapper = tracer.directory / "traced_server.py"
        wrapper.write_text(TRACED_SERVER)
        os.environ["BENCH_SERVER_SCRIPT"] = str(wrapper)
        os.environ["SOAK_SNAPSHOT_DIR"] = str(tracer.directory)
    with scratch, fresh_database(args.database, "soak") as url:
        setup_vramtune_study(url, cell, n_trials=args.study_trials)
        with vramtune_server(url) as (port, server):
            threads = [
                threading.Thread(target=worker_loop, args=(port, i, state), daemon=True)
                for i in range(args.workers)
            ]
            threads.append(
                threading.Thread(target=rotator_loop, args=(port, args, state), daemon=True)
            )
            for thread in threads:
                thread.start()
            samples = sample_loop(server, args, state, tracer)
            state.stop.set()
            for thread in threads:
                thread.join(30)
        heap = None if tracer is None else heap_report(tracer)
    return {
        "samples": [asdict(s) for s in samples],
        "trials": state.trials,
        "studies": state.studies,
        "errors": state.errors[:20],
        "verdict": verdict(samples, args),
        "tracemalloc": heap,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the soak and write bench/results/soak.{md,json}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--database", choices=["postgresql", "sqlite"], default="postgresql")
    parser.add_argument("--sampler", choices=["random", "tpe"], default="tpe")
    parser.add_argument("--study-trials", type=int, default=300)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--max-growth-mib", type=float, default=20.0)
    parser.add_argument("--max-growth-mib-per-hour", type=float, default=60.0)
    parser.add_argument(
        "--tracemalloc", action="store_true", help="trace the server's Python heap (slower)"
    )
    parser.add_argument("--out", default=str(REPO / "bench/results/soak"))
    args = parser.parse_args(argv)
    result = run(args)
    result["meta"] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} cores, {platform.platform()}",
        **{k: v for k, v in vars(args).items() if k != "out"},
    }
    print(
        json.dumps(result["verdict"]),
        f"trials {result['trials']}",
        f"errors {len(result['errors'])}",
    )
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(result, indent=1))
        Path(f"{args.out}.md").write_text(markdown(result))
    return 0 if result["verdict"]["flat"] and not result["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
