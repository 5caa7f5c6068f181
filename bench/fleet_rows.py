"""Worker rows and fleet listings at scale (issue 30, item 8): does a register/stop loop grow
the workers table, and what does listing a 2,139-worker fleet cost, a page at a time?

One real `vramtune serve` (auth on, max_workers_per_token=LIMIT) on a fresh database:

- phase A: ROUNDS register/stop rounds from one token; the token's rows after, and the
  registration latency (median, p99) of the first and the last 500 rounds (retiring on
  register must not slow registration as the loop goes on);
- phase B: 2,139 workers (the fleet the issue measured at 750 KB unpaginated) from three more
  tokens; the bytes and latency (median of 20) of GET /api/v1/workers and
  /api/v1/dashboard/fleet at their default page, and the bytes of every page together.

Usage: ``flock /tmp/bench.lock python bench/fleet_rows.py [--database sqlite|postgresql]
[--out bench/results]``. Writes fleet_rows.json and .md, with the 1-minute load average.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
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

LIMIT = 1000
ROUNDS = 3000
FLEET = 2139
CARD = {"model": "Sim", "total_bytes": 2**33, "free_bytes": 2**33, "simulated": True}


def load_average() -> float:
    """The 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def token(http: httpx.Client) -> str:
    """A new worker + read token."""
    response = http.post("/tokens", json={"name": "bench", "scopes": ["worker", "read"]})
    response.raise_for_status()
    return str(response.json()["token"])


def register(http: httpx.Client) -> int:
    """A new worker's id."""
    body = {"name": "bench", "device": "cpu", "card": CARD, "tasks": ["quadratic"]}
    response = http.post("/workers", json=body)
    response.raise_for_status()
    return int(response.json()["worker_id"])


def quantiles(seconds: list[float]) -> dict[str, float]:
    """Median and p99 in ms."""
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50_ms": statistics.median(ordered) * 1000, "p99_ms": p99 * 1000}


def register_stop_loop(http: httpx.Client) -> dict[str, Any]:
    """Phase A: ROUNDS register/stop rounds; registration latency at the start and the end."""
    latencies: list[float] = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        worker_id = register(http)
        latencies.append(time.perf_counter() - started)
        http.post(f"/workers/{worker_id}/stop").raise_for_status()
    listed = http.get("/workers", params={"limit": 1})
    return {
        "rounds": ROUNDS,
        "rows_after": listed.json()["total"],
        "first_500": quantiles(latencies[:500]),
        "last_500": quantiles(latencies[-500:]),
        "load_1min": load_average(),
    }


def listing(http: httpx.Client, path: str, page_size: int) -> dict[str, Any]:
    """Bytes and latency of the default page; bytes of every page together."""
    timings, size = [], 0
    for _ in range(20):
        started = time.perf_counter()
        response = http.get(path)
        timings.append(time.perf_counter() - started)
        response.raise_for_status()
        size = len(response.content)
    total, every, offset = response.json()["total"], 0, 0
    while offset < total:
        every += len(http.get(path, params={"offset": offset, "limit": page_size}).content)
        offset += page_size
    return {
        "workers": total,
        "default_page_bytes": size,
        "every_page_bytes": every,
        "default_page": quantiles(timings),
        "load_1min": load_average(),
    }


def run(database: str) -> dict[str, Any]:
    """Both phases on one fresh server."""
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        directory = Path(tmp)
        url = stack.enter_context(fresh_postgres_database()) if database == "postgresql" else ""
        url = url or sqlite_url(directory)
        upgraded = run_vramtune(
            "db", "upgrade", "--database-url", url, env={"VRAMTUNE_ADMIN_TOKEN": ""}
        )
        assert upgraded.returncode == 0, upgraded.stderr
        admin = next(
            line for line in upgraded.stdout.splitlines() if line.startswith("first admin")
        ).split()[-1]
        start = stack.enter_context(server_factory(directory))
        server = start(url, auth="on", max_workers_per_token=LIMIT, log_level="warning")
        base = f"{server.url}/api/v1"

        def client(bearer: str) -> httpx.Client:
            headers = {"Authorization": f"Bearer {bearer}"}
            return stack.enter_context(httpx.Client(base_url=base, headers=headers, timeout=60))

        boss = client(admin)
        loop = register_stop_loop(client(token(boss)))
        for count in (LIMIT, LIMIT, FLEET - 2 * LIMIT):
            fleet_token = client(token(boss))
            for _ in range(count):
                register(fleet_token)
        return {
            "database": database,
            "max_workers_per_token": LIMIT,
            "register_stop_loop": loop,
            "workers": listing(boss, "/workers", 1000),
            "dashboard_fleet": listing(boss, "/dashboard/fleet", 500),
        }


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    loop = result["register_stop_loop"]
    lines = [
        f"# Worker rows and fleet listings ({result['database']}, {result['at']})",
        "",
        f"{loop['rounds']} register/stop rounds from one token (limit "
        f"{result['max_workers_per_token']}): {loop['rows_after']} rows after; registration "
        f"p50/p99 {loop['first_500']['p50_ms']:.1f}/{loop['first_500']['p99_ms']:.1f} ms over "
        f"the first 500 rounds, {loop['last_500']['p50_ms']:.1f}/"
        f"{loop['last_500']['p99_ms']:.1f} ms over the last 500 (load {loop['load_1min']}).",
        "",
        "| listing | workers | default page | its p50 / p99 | every page together | load |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("workers", "dashboard_fleet"):
        row = result[name]
        lines.append(
            f"| {name} | {row['workers']} | {row['default_page_bytes'] / 1024:.0f} KiB | "
            f"{row['default_page']['p50_ms']:.0f} / {row['default_page']['p99_ms']:.0f} ms | "
            f"{row['every_page_bytes'] / 1024:.0f} KiB | {row['load_1min']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    result = {"at": datetime.now(UTC).isoformat(timespec="seconds"), **run(args.database)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fleet_rows.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "fleet_rows.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
