"""What a registration flood from one token costs: 10,000 registrations past the per-token limit.

One real `vramtune serve` (auth on, max_workers_per_token=40) on a fresh database. Measured in
the same run, side by side:

- server CPU seconds (utime + stime of the server process, from /proc) per heartbeat of another
  token's worker, and per registration of the flooding token (almost all 429s);
- the other worker's heartbeat latency (median, p99) alone, and while 8 threads send the flood.

Usage: ``python bench/registration_flood.py [--database sqlite|postgresql] [--out bench/results]``
(bounded: about a minute on two cores). Writes registration_flood.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vramtune.service.testing import (  # noqa: E402
    fresh_postgres_database,
    run_vramtune,
    server_factory,
    sqlite_url,
)

FLOOD = 10_000
THREADS = 8
BEATS = 1_000
LIMIT = 40
CARD = {"model": "Sim", "total_bytes": 2**30, "free_bytes": 2**30, "simulated": True}


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def token(base: str, admin: str, name: str) -> str:
    body = {"name": name, "scopes": ["worker"]}
    answer = httpx.post(f"{base}/tokens", json=body, headers={"Authorization": f"Bearer {admin}"})
    answer.raise_for_status()
    return str(answer.json()["token"])


def client(base: str, bearer: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {bearer}"}, timeout=60)


def beats(http: httpx.Client, worker_id: int, count: int) -> list[float]:
    """Latencies (s) of `count` heartbeats; each must be a 200."""
    latencies = []
    for _ in range(count):
        began = time.perf_counter()
        answer = http.post(f"/workers/{worker_id}/heartbeat", json={})
        latencies.append(time.perf_counter() - began)
        assert answer.status_code == 200, answer.text
    return latencies


def register(http: httpx.Client, count: int) -> Counter[int]:
    body = {"name": "flood", "device": "cpu", "card": CARD, "tasks": ["quadratic"]}
    return Counter(http.post("/workers", json=body).status_code for _ in range(count))


def summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "median_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1] * 1000, 3),
    }


def run(database: str) -> dict[str, Any]:
    with ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        url = (
            sqlite_url(directory)
            if database == "sqlite"
            else stack.enter_context(fresh_postgres_database())
        )
        upgraded = run_vramtune(
            "db", "upgrade", "--database-url", url, env={"VRAMTUNE_ADMIN_TOKEN": ""}
        )
        admin = next(
            line for line in upgraded.stdout.splitlines() if line.startswith("first admin")
        ).split()[-1]
        start = stack.enter_context(server_factory(directory))
        server = start(url, auth="on", max_workers_per_token=LIMIT, log_level="warning")
        assert server.process is not None
        pid, base = server.process.pid, f"{server.url}/api/v1"
        bystander = stack.enter_context(client(base, token(base, admin, "bystander")))
        flooder = stack.enter_context(client(base, token(base, admin, "flood")))
        body = {"name": "bystander", "device": "cpu", "card": CARD, "tasks": ["quadratic"]}
        worker_id = int(bystander.post("/workers", json=body).json()["worker_id"])
        beats(bystander, worker_id, 100)  # warm up
        before = {"loadavg": loadavg()}

        cpu = cpu_seconds(pid)
        alone = beats(bystander, worker_id, BEATS)
        per_beat = (cpu_seconds(pid) - cpu) / BEATS
        cpu = cpu_seconds(pid)
        sequential = register(flooder, FLOOD)
        per_registration = (cpu_seconds(pid) - cpu) / FLOOD

        def flood_slice(_: int) -> Counter[int]:
            with client(base, flooder.headers["Authorization"].split()[1]) as http:
                return register(http, FLOOD // THREADS)

        with ThreadPoolExecutor(THREADS) as pool:
            floods = [pool.submit(flood_slice, i) for i in range(THREADS)]
            during: list[float] = []
            while not all(f.done() for f in floods):
                during += beats(bystander, worker_id, 10)
            concurrent = sum((f.result() for f in floods), Counter())
        after = loadavg()
    return {
        "database": database,
        "loadavg_before": before["loadavg"],
        "loadavg_after": after,
        "limit": LIMIT,
        "sequential_statuses": dict(sequential),
        "concurrent_statuses": dict(concurrent),
        "server_cpu_ms_per_heartbeat": round(per_beat * 1000, 3),
        "server_cpu_ms_per_refused_registration": round(per_registration * 1000, 3),
        "refusal_to_heartbeat_cpu_ratio": round(per_registration / per_beat, 2),
        "heartbeat_alone": summary(alone),
        "heartbeat_during_flood": summary(during),
        "heartbeats_during_flood": len(during),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--database", choices=["sqlite", "postgresql"], action="append")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    results = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "runs": [run(database) for database in args.database or ["sqlite", "postgresql"]],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "registration_flood.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "# Registration flood (bench/registration_flood.py)",
        "",
        f"{FLOOD} registrations from one worker token past a limit of {LIMIT} live workers, "
        f"one real server (auth on); measured {results['when']}.",
        "",
        "| database | load before / after | CPU ms / heartbeat | CPU ms / refused registration "
        "| ratio | heartbeat alone (median / p99 ms) | during an 8-thread flood |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        alone, during = r["heartbeat_alone"], r["heartbeat_during_flood"]
        lines.append(
            f"| {r['database']} | {r['loadavg_before']} / {r['loadavg_after']} "
            f"| {r['server_cpu_ms_per_heartbeat']} | {r['server_cpu_ms_per_refused_registration']} "
            f"| {r['refusal_to_heartbeat_cpu_ratio']} | {alone['median_ms']} / {alone['p99_ms']} "
            f"| {during['median_ms']} / {during['p99_ms']} |"
        )
    (args.out / "registration_flood.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
