"""How fast the study page opens at 10,000 trials: vramtune's dashboard beside optuna-dashboard.

Seeds one SQLite database with a study of N trials (5 float + 1 categorical parameters, 10
intermediate values each, vramtune's trial records, memory observations and workers), then in
headless Chromium measures the time from navigation until each dashboard's study page has drawn
its plots, and the size and time of vramtune's JSON endpoints. Both dashboards read the same file.

    .venv/bin/python bench/dashboard_scale.py [--trials 10000] [--optuna-dashboard-timeout 180]

Writes bench/results/dashboard_scale.{md,json}. Seeding writes rows in bulk through Optuna's own
ORM tables: ``study.add_trials`` costs ~33 ms per trial on SQLite here (5.5 min for 10,000).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import optuna
from optuna.distributions import (
    CategoricalDistribution,
    FloatDistribution,
    distribution_to_json,
)
from optuna.storages._rdb import models
from optuna.trial import TrialState
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from sqlalchemy import insert
from sqlalchemy.orm import Session

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from service import migrate  # noqa: E402
from service.db import make_engine  # noqa: E402
from service.tables import (  # noqa: E402
    MemoryObservationRow,
    StudyRow,
    TrialRow,
    WorkerRow,
)
from service.wire import StudyCreate  # noqa: E402
from tests.browser.chromium import launch  # noqa: E402

GIB = 1024**3
IV_FINITE = models.TrialIntermediateValueModel.TrialIntermediateValueType.FINITE
RESULTS = REPO / "bench" / "results"
ARTIFACTS = REPO / "test-artifacts"
STUDY = "scale-10k"
STEPS = 10
REPEATS = 3  # later visits, each in a new browser; the median is reported
CARDS = [("NVIDIA A100-SXM4-40GB", 40 * GIB), ("NVIDIA H200", 141 * GIB)]
SPACE: dict[str, Any] = {
    "lr": FloatDistribution(1e-5, 1e-1, log=True),
    "dropout": FloatDistribution(0.0, 0.5),
    "weight_decay": FloatDistribution(1e-6, 1e-1, log=True),
    "width": FloatDistribution(0.25, 4.0),
    "batch_scale": FloatDistribution(0.25, 8.0, log=True),
    "optimizer": CategoricalDistribution(["adamw", "sgd", "lion"]),
}


# ---------------------------------------------------------------- seeding


def seed(url: str, n_trials: int, rng: random.Random) -> int:
    """A migrated database with one vramtune study of n_trials finished trials; its study id."""
    engine = make_engine(url)
    migrate.upgrade(engine)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=url, study_name=STUDY, direction="minimize")
    study_id = study._study_id
    now = datetime.now(UTC).replace(tzinfo=None)
    start = now - timedelta(seconds=30 * n_trials / 4)
    with Session(engine) as session, session.begin():
        session.add(_study_row(study_id, start))
        workers = _workers(session, now)
        rows = [_trial(study_id, number, start, rng, workers) for number in range(n_trials)]
        _bulk(session, rows, study_id)
    engine.dispose()
    return study_id


def _study_row(study_id: int, created: datetime) -> StudyRow:
    spec = StudyCreate.model_validate(
        {
            "name": STUDY,
            "task": "gpt-small",
            "search_space": {
                "lr": {"type": "float", "low": 1e-5, "high": 1e-1, "log": True},
                "dropout": {"type": "float", "low": 0.0, "high": 0.5},
                "weight_decay": {"type": "float", "low": 1e-6, "high": 1e-1, "log": True},
                "width": {"type": "float", "low": 0.25, "high": 4.0},
                "batch_scale": {"type": "float", "low": 0.25, "high": 8.0, "log": True},
                "optimizer": {"type": "categorical", "choices": ["adamw", "sgd", "lion"]},
            },
            "n_trials": 20000,
        }
    )
    return StudyRow(
        study_id=study_id,
        name=STUDY,
        task=spec.task,
        spec=spec.model_dump(mode="json"),
        paused=False,
        created_at=created,
    )


def _workers(session: Session, now: datetime) -> list[WorkerRow]:
    workers = []
    for index in range(8):
        model, total = CARDS[index % len(CARDS)]
        worker = WorkerRow(
            name=f"gpu-node-{index // 2}-{index % 2}",
            device=f"cuda:{index % 2}",
            card_model=model,
            total_bytes=total,
            free_bytes=int(total * 0.95),
            card={"model": model, "total_bytes": total, "free_bytes": int(total * 0.95)},
            constants={},
            tasks=["gpt-small"],
            registered_at=now - timedelta(hours=3),
            last_heartbeat=now,
            stopped=False,
            trials_done=0,
        )
        session.add(worker)
        workers.append(worker)
    session.flush()
    return workers


def _trial(
    study_id: int, number: int, start: datetime, rng: random.Random, workers: list[WorkerRow]
) -> dict[str, Any]:
    """One synthetic trial: parameters, a loss, a memory footprint and how it ran."""
    params = {name: dist.to_internal_repr(_sample(dist, rng)) for name, dist in SPACE.items()}
    external = {name: SPACE[name].to_external_repr(v) for name, v in params.items()}
    loss = (
        (math.log10(external["lr"]) + 3) ** 2 * 0.3
        + (external["dropout"] - 0.1) ** 2
        + 0.5 / external["width"]
        + {"adamw": 0.0, "sgd": 0.25, "lion": 0.05}[external["optimizer"]]
        + rng.gauss(0, 0.05)
    )
    need = int((2 + 6 * external["width"] * external["batch_scale"]) * GIB)
    worker = workers[number % len(workers)]
    state, outcome, plan, measured = _fate(need, worker.total_bytes, rng)
    began = start + timedelta(seconds=30 * number / 4)
    return {
        "number": number,
        "params": params,
        "loss": loss,
        "state": state,
        "outcome": outcome,
        "plan": plan,
        "need": need,
        "predicted": min(need, int(worker.total_bytes * 0.9)) if plan else need,
        "measured": measured,
        "worker": worker,
        "start": began,
        "end": began + timedelta(seconds=rng.uniform(20, 60)),
    }


def _sample(dist: Any, rng: random.Random) -> Any:
    if isinstance(dist, CategoricalDistribution):
        return rng.choice(dist.choices)
    if dist.log:
        return math.exp(rng.uniform(math.log(dist.low), math.log(dist.high)))
    return rng.uniform(dist.low, dist.high)


def _fate(
    need: int, card: int, rng: random.Random
) -> tuple[TrialState, str, dict[str, Any] | None, int | None]:
    """State, outcome, plan and measured peak of a trial needing ``need`` bytes on ``card``."""
    fits = int(card * 0.9)
    if need > 8 * fits:  # as vramtune ends it: COMPLETE, a placeholder value, a constraint > 0
        return TrialState.COMPLETE, "infeasible", None, None
    if rng.random() < 0.01:
        return TrialState.FAIL, "oom", {"micro_batch": 8}, int(card * 0.99)
    if rng.random() < 0.08:
        return TrialState.PRUNED, "pruned", {}, int(min(need, fits) * rng.uniform(0.9, 1.05))
    if need <= fits:
        return TrialState.COMPLETE, "as_asked", {}, int(need * rng.uniform(0.93, 1.04))
    split = 2 ** math.ceil(math.log2(need / fits))
    plan = {"micro_batch": max(1, 64 // split), "accumulation": split, "reason": "does not fit"}
    return TrialState.COMPLETE, "resized", plan, int(fits * rng.uniform(0.8, 1.02))


def _bulk(session: Session, rows: list[dict[str, Any]], study_id: int) -> None:
    """Insert every row of every table in a handful of executemany statements."""
    first_id = 1 + (session.query(models.TrialModel.trial_id).count())
    dist_json = {name: distribution_to_json(dist) for name, dist in SPACE.items()}
    trials, params, values, steps, records, observations, attrs = [], [], [], [], [], [], []
    for offset, row in enumerate(rows):
        trial_id = first_id + offset
        trials.append(
            {
                "trial_id": trial_id,
                "number": row["number"],
                "study_id": study_id,
                "state": row["state"],
                "datetime_start": row["start"],
                "datetime_complete": row["end"],
            }
        )
        params += [
            {
                "trial_id": trial_id,
                "param_name": k,
                "param_value": v,
                "distribution_json": dist_json[k],
            }
            for k, v in row["params"].items()
        ]
        n_steps = {"infeasible": 0, "oom": 2}.get(row["outcome"], STEPS)  # never ran / died early
        steps += [
            {
                "trial_id": trial_id,
                "step": step,
                "intermediate_value": row["loss"] + 2.0 / (step + 1),
                "intermediate_value_type": IV_FINITE,
            }
            for step in range(n_steps)
        ]
        if row["state"] == TrialState.COMPLETE:
            values.append(
                {
                    "trial_id": trial_id,
                    "objective": 0,
                    "value": row["loss"],
                    "value_type": models.TrialValueModel.TrialValueType.FINITE,
                }
            )
        records.append(_record(trial_id, study_id, row))
        attrs += _constraints(trial_id, row)
        if row["measured"] is not None:
            observations.append(_observation(trial_id, study_id, row))
    for table, batch in (
        (models.TrialModel.__table__, trials),
        (models.TrialParamModel.__table__, params),
        (models.TrialValueModel.__table__, values),
        (models.TrialIntermediateValueModel.__table__, steps),
        (models.TrialSystemAttributeModel.__table__, attrs),
        (TrialRow.__table__, records),
        (MemoryObservationRow.__table__, observations),
    ):
        session.execute(insert(table), batch)


def _constraints(trial_id: int, row: dict[str, Any]) -> list[dict[str, Any]]:
    """The memory constraint vramtune sets on every trial, in Optuna's new and old keys."""
    worker: WorkerRow = row["worker"]
    violation = row["need"] / (8 * 0.9 * worker.total_bytes) - 1  # > 0: fits no card
    return [
        {"trial_id": trial_id, "key": "constraints:memory", "value_json": json.dumps(violation)},
        {"trial_id": trial_id, "key": "constraints", "value_json": json.dumps([violation])},
    ]


def _record(trial_id: int, study_id: int, row: dict[str, Any]) -> dict[str, Any]:
    worker: WorkerRow = row["worker"]
    return {
        "trial_id": trial_id,
        "study_id": study_id,
        "number": row["number"],
        "status": "done",
        "attempt": 1 if row["outcome"] == "oom" else 0,
        "min_bytes": 0,
        "outcome": row["outcome"],
        "worker_id": None if row["outcome"] == "infeasible" else worker.id,
        "plan": row["plan"],
        "plans_tried": [],
        "predicted_peak_bytes": row["predicted"],
        "measured_peak_bytes": row["measured"],
        "message": "no card of the fleet holds it" if row["outcome"] == "infeasible" else None,
        "updated_at": row["end"],
    }


def _observation(trial_id: int, study_id: int, row: dict[str, Any]) -> dict[str, Any]:
    worker: WorkerRow = row["worker"]
    return {
        "trial_id": trial_id,
        "study_id": study_id,
        "worker_id": worker.id,
        "card_model": worker.card_model,
        "torch_version": "2.13.0",
        "task": "gpt-small",
        "plan": row["plan"] or {},
        "outcome": row["outcome"],
        "predicted_allocated": row["predicted"],
        "predicted_reserved": row["predicted"],
        "measured_allocated": row["measured"],
        "measured_reserved": row["measured"],
        "nvml_peak": None,
        "created_at": row["end"],
    }


# ---------------------------------------------------------------- servers


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def process(
    command: list[str], ready_url: str, log: Path, env: dict[str, str] | None = None
) -> Iterator[None]:
    """A server subprocess, up once ready_url answers; terminated at the end."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **(env or {})},
        )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited:\n{log.read_text()}")
            try:
                if httpx.get(ready_url, timeout=2).status_code < 500:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- measuring


def time_endpoints(base: str) -> list[dict[str, Any]]:
    """Size and time of each JSON endpoint the study page calls (cold, then warm)."""
    prefix = f"{base}/api/v1/dashboard/studies/{STUDY}"
    paths = [
        "",
        "/history",
        "/memory",
        "/calibration",
        "/regions?x=width&y=batch_scale",
        "/importances",
        "/trials?sort=number&order=desc&limit=50",
        "/trials?sort=param:lr&order=asc&state=COMPLETE&limit=50&offset=5000",
        "/trials/42",
    ]
    out = []
    with httpx.Client(timeout=120) as client:
        client.get(f"{base}/api/v1/dashboard/studies")
        for path in paths:
            timings = []
            for _ in range(3):
                began = time.perf_counter()
                response = client.get(prefix + path)
                timings.append(time.perf_counter() - began)
                response.raise_for_status()
            out.append(
                {
                    "endpoint": f"/api/v1/dashboard/studies/{{name}}{path}",
                    "bytes": len(response.content),
                    "first_s": round(timings[0], 4),
                    "warm_s": round(min(timings[1:]), 4),
                }
            )
    return out


def page_time(url: str, ready: str, timeout_s: float, shot: str) -> dict[str, Any]:
    """Seconds until the page is drawn, measured in a child process killed past the bound.

    A page that busies its renderer (optuna-dashboard parsing 23 MB of JSON) can keep even
    playwright's own timeout from firing: the child, its browser included, is killed instead.
    """
    command = [sys.executable, __file__, "--page", url, "--ready", ready]
    command += ["--timeout", str(timeout_s), "--shot", shot]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, start_new_session=True, cwd=REPO)
    try:
        out, _ = child.communicate(timeout=timeout_s + 60)
        result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
        return result
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return {"seconds": None, "timeout_s": timeout_s, "console_errors": ["killed at the bound"]}


def measure_page(url: str, ready: str, timeout_s: float, shot: str) -> dict[str, Any]:
    """Seconds from navigation until the ready check holds, in a new headless Chromium."""
    ready_js = {"vramtune": VRAMTUNE_READY, "optuna": OPTUNA_READY}[ready]
    with launch() as browser:
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        began = time.perf_counter()
        page.goto(url, wait_until="commit", timeout=timeout_s * 1000)
        seconds: float | None
        others: float | None = None
        try:
            if ready == "vramtune":  # when the plots but the importances were drawn, too
                page.wait_for_function(VRAMTUNE_OTHERS, timeout=timeout_s * 1000, polling=50)
                others = time.perf_counter() - began
            page.wait_for_function(ready_js, timeout=timeout_s * 1000, polling=50)
            seconds = time.perf_counter() - began
        except PlaywrightTimeout:  # the bounded wait ran out: reported as such
            seconds = None
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{shot}.png"), timeout=30_000)
        return {
            "seconds": seconds,
            "all_but_importances_s": others,
            "timeout_s": timeout_s,
            "console_errors": errors[:5],
        }


VRAMTUNE_READY = """() => {
  if (!document.body.dataset.rendered) return false;
  const plots = [...document.querySelectorAll('.plot')];
  return plots.length === 6 && plots.every(p => Number(p.dataset.points) > 0);
}"""
VRAMTUNE_OTHERS = """() => {
  const plots = [...document.querySelectorAll('.plot')].filter(p => p.id !== 'plot-importances');
  return plots.length === 5 && plots.every(p => Number(p.dataset.points) > 0);
}"""
# optuna-dashboard's study page is drawn once its plots hold points (history and the others).
OPTUNA_READY = """() =>
  document.querySelectorAll('.js-plotly-plot .scatterlayer .trace .points path').length > 0
  && document.querySelectorAll('.js-plotly-plot').length >= 3"""


@contextmanager
def vramtune_server(url: str, log: Path) -> Iterator[str]:
    """`vramtune serve` on the database (auth off); its base URL."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port)]
    serve += ["--database-url", url]
    with process(serve, f"{base}/api/v1/health", log, {"VRAMTUNE_AUTH": "off"}):
        yield base


def measure_vramtune(url: str, tmp: Path) -> dict[str, Any]:
    """The study page, first and later visits; then the endpoints, on a fresh server."""
    with vramtune_server(url, tmp / "vramtune.log") as base:
        page = f"{base}/studies/{STUDY}"
        first = page_time(page, "vramtune", 60, "scale-vramtune-first")
        again = [page_time(page, "vramtune", 60, "scale-vramtune") for _ in range(REPEATS)]
    drawn = [r["seconds"] for r in again if r["seconds"] is not None]
    median = {"seconds": statistics.median(drawn) if drawn else None, "timeout_s": 60}
    with vramtune_server(url, tmp / "vramtune-endpoints.log") as base:
        endpoints = time_endpoints(base)  # a fresh server: every first call is computed
    return {
        "vramtune_page": first,
        "vramtune_page_again": median | {"runs": [r["seconds"] for r in again]},
        "endpoints": endpoints,
    }


def measure_optuna_dashboard(
    url: str, study_id: int, tmp: Path, timeout_s: float
) -> dict[str, Any]:
    """`optuna-dashboard URL` on the same database: its study page, within timeout_s."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).with_name("optuna-dashboard")), url]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    with process(command, f"{base}/api/studies", tmp / "optuna-dashboard.log"):
        page = f"{base}/dashboard/studies/{study_id}"
        return page_time(page, "optuna", timeout_s, "scale-optuna-dashboard")


def main() -> None:
    """Seed, serve both dashboards, measure, write the results."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--optuna-dashboard-timeout", type=float, default=180.0)
    parser.add_argument("--skip-optuna-dashboard", action="store_true")
    parser.add_argument("--page", help=argparse.SUPPRESS)  # the child of page_time
    parser.add_argument("--ready", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--shot", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.page:
        print(json.dumps(measure_page(args.page, args.ready, args.timeout, args.shot)))
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/scale.db"
        began = time.perf_counter()
        study_id = seed(url, args.trials, random.Random(7))
        seeded_s = time.perf_counter() - began
        check = optuna.load_study(study_name=STUDY, storage=url)
        assert len(check.trials) == args.trials, "Optuna does not read back the seeded trials"
        results: dict[str, Any] = {
            "trials": args.trials,
            "seed_seconds": round(seeded_s, 1),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "load_average_before": os.getloadavg()[0],
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        results |= measure_vramtune(url, Path(tmp))
        if not args.skip_optuna_dashboard:
            timeout = args.optuna_dashboard_timeout
            results["optuna_dashboard_page"] = measure_optuna_dashboard(
                url, study_id, Path(tmp), timeout
            )
    write_results(results)


def write_results(results: dict[str, Any]) -> None:
    """bench/results/dashboard_scale.json and a markdown table of it."""
    (RESULTS / "dashboard_scale.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "dashboard_scale.md").write_text(markdown(results))
    print(markdown(results))


def _seconds(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "not run"
    if entry["seconds"] is None:
        return f"not drawn within {entry['timeout_s']:.0f} s"
    return f"{entry['seconds']:.2f} s"


def _others(r: dict[str, Any]) -> str:
    seconds = (r.get("vramtune_page") or {}).get("all_but_importances_s")
    return "not drawn" if seconds is None else f"{seconds:.2f} s"


def markdown(r: dict[str, Any]) -> str:
    """The results as a markdown page."""
    later = r.get("vramtune_page_again") or {}
    runs = ", ".join(_seconds({"seconds": s, "timeout_s": 60}) for s in later.get("runs", []))
    lines = [
        f"# Dashboard at scale: a study of {r['trials']:,} trials",
        "",
        f"{r['machine']} (load average {r['load_average_before']:.1f} when it began); SQLite;",
        f"5 float + 1 categorical parameters, {STEPS} intermediate values per trial, vramtune's",
        f"trial records and memory observations; {r['when']}; `bench/dashboard_scale.py`.",
        "",
        "Time from navigation until the study page has drawn all its plots, headless Chromium",
        "(a new browser for every visit, so nothing is cached in the browser):",
        "",
        "| dashboard | study page drawn |",
        "|---|---|",
        f"| vramtune, first visit | {_seconds(r.get('vramtune_page'))} |",
        f"| vramtune, first visit, every plot but the importances | {_others(r)} |",
        f"| vramtune, later visits (median of {REPEATS}: {runs})"
        f" | {_seconds(r.get('vramtune_page_again'))} |",
        f"| optuna-dashboard 0.21.0 | {_seconds(r.get('optuna_dashboard_page'))} |",
        "",
        "- First visit: right after the server answered its health check. Every answer is",
        "  computed, and the importances wait for `import optuna.importance`, which imports",
        "  scikit-learn (for fANOVA, unused here) when it is installed, as in this all-extras",
        "  environment: seconds, once per process. The server does that import in the",
        "  background a few seconds after it starts; a server-only install has no scikit-learn.",
        "- Later visits: the server answers the plots from its cache, keyed by the study's",
        "  revision (a finished study's plots are computed once per server process).",
        "- optuna-dashboard: its page asks for every trial at once (one JSON of all trials) and",
        "  asks again on its 10 s timer before the first answer is drawn; FACTS.md measured",
        "  96-138 s here at 10,000 trials. Bounded wait.",
        "",
        "vramtune's JSON endpoints on this study (a first call, then the best of two repeats,",
        "which the revision cache answers):",
        "",
        "| endpoint | bytes | first call | repeated |",
        "|---|---:|---:|---:|",
    ]
    for e in r.get("endpoints", []):
        lines.append(
            f"| `{e['endpoint']}` | {e['bytes']:,} | {e['first_s'] * 1000:.0f} ms"
            f" | {e['warm_s'] * 1000:.0f} ms |"
        )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
