"""How fast the study page opens at 10,000 trials: vramtune's dashboard beside optuna-dashboard.

Seeds one SQLite database with a study of N trials (5 float + 1 categorical parameters, 10
intermediate values each, vramtune's trial records, memory observations and workers), then in
headless Chromium measures the time from navigation until vramtune's study page is open
(history, memory plot and trial table drawn), fully drawn, and has its importances, on the first
visit after each of three fresh server starts and on later visits; optuna-dashboard's study page
on the same file; and the size and time of vramtune's JSON endpoints.

    .venv/bin/python bench/dashboard_scale.py [--trials 10000] [--optuna-dashboard-timeout 180]
        [--skip-optuna-dashboard]

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
from playwright.sync_api import Error as PlaywrightError, TimeoutError as PlaywrightTimeout
from sqlalchemy import insert
from sqlalchemy.orm import Session

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.browser.chromium import launch  # noqa: E402
from vramtune.service.dashboard.importance import QUIET_S  # noqa: E402
from vramtune.service.db import migrate  # noqa: E402
from vramtune.service.db.engine import make_engine  # noqa: E402
from vramtune.service.db.tables import (  # noqa: E402
    MemoryObservationRow,
    StudyRow,
    TrialRow,
    WorkerRow,
)
from vramtune.service.wire import StudyCreate  # noqa: E402

GIB = 1024**3
IV_FINITE = models.TrialIntermediateValueModel.TrialIntermediateValueType.FINITE
RESULTS = REPO / "bench" / "results"
ARTIFACTS = REPO / "test-artifacts"
STUDY = "scale-10k"
STEPS = 10
SERVER_STARTS = 3  # fresh server processes, each visited once right after it answered
LATER_VISITS = 2  # visits per server after its first one, each in a new browser
# A server left alone this long after its start has imported the importance evaluators.
SETTLED_S = QUIET_S + 5.0
PAGE_BOUND_S = 60.0
TARGET_S = 2.0  # the mark for the study page at 10,000 trials
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
    """The page's milestones (seconds), measured in a child process killed past the bound.

    A page that busies its renderer (optuna-dashboard parsing 23 MB of JSON) can keep even
    playwright's own timeout from firing: the child, its browser included, is killed instead.
    """
    command = [sys.executable, __file__, "--page", url, "--ready", ready]
    command += ["--timeout", str(timeout_s), "--shot", shot]
    load = os.getloadavg()[0]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, start_new_session=True, cwd=REPO)
    result: dict[str, Any]
    try:
        out, _ = child.communicate(timeout=timeout_s * 3 + 60)
        result = json.loads(out.decode().strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        result = {"console_errors": ["killed at the bound"]}
    except (IndexError, ValueError):  # the child died before printing its result
        result = {"console_errors": [f"the measuring process exited {child.returncode}"]}
    return result | {"timeout_s": timeout_s, "load_average": round(load, 1)}


# What each milestone waits for. vramtune's page is open once its history and memory plots and
# its trial table are drawn; every other plot but the importances follows (data-rendered), and
# the importances last, asked for once the rest is drawn.
VRAMTUNE_MILESTONES = {
    "open_s": """() => ['history', 'memory'].every(p =>
        Number(document.querySelector('#plot-' + p).dataset.points) > 0)
      && document.querySelectorAll('#trials tbody tr[data-number]').length > 0""",
    "drawn_s": "() => Boolean(document.body.dataset.rendered)",
    "importances_s": """() => Boolean(document.body.dataset.importances)
      && Number(document.querySelector('#plot-importances').dataset.points) > 0""",
}
# optuna-dashboard's study page is drawn once its plots hold points (history and the others).
OPTUNA_MILESTONES = {
    "drawn_s": """() =>
      document.querySelectorAll('.js-plotly-plot .scatterlayer .trace .points path').length > 0
      && document.querySelectorAll('.js-plotly-plot').length >= 3""",
}


def measure_page(url: str, ready: str, timeout_s: float, shot: str) -> dict[str, Any]:
    """Seconds from navigation until each milestone holds, in a new headless Chromium."""
    milestones = {"vramtune": VRAMTUNE_MILESTONES, "optuna": OPTUNA_MILESTONES}[ready]
    with launch() as browser:
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        began = time.perf_counter()
        page.goto(url, wait_until="commit", timeout=timeout_s * 1000)
        found: dict[str, Any] = {}
        for name, check in milestones.items():  # in the order they come
            try:
                page.wait_for_function(check, timeout=timeout_s * 1000, polling=50)
                found[name] = round(time.perf_counter() - began, 3)
            except PlaywrightTimeout:  # the bounded wait ran out: reported as such
                found[name] = None
        ARTIFACTS.mkdir(exist_ok=True)
        try:
            page.screenshot(path=str(ARTIFACTS / f"{shot}.png"), timeout=30_000)
        except PlaywrightError as error:  # a renderer still busy past the bound draws nothing
            errors.append(f"no screenshot: {error.message.splitlines()[0]}")
        return found | {"console_errors": errors[:5]}


@contextmanager
def vramtune_server(url: str, log: Path) -> Iterator[str]:
    """`vramtune serve` on the database (auth off); its base URL."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "vramtune", "serve", "--host", "127.0.0.1", "--port", str(port)]
    serve += ["--database-url", url]
    with process(serve, f"{base}/api/v1/health", log, {"VRAMTUNE_AUTH": "off"}):
        yield base


def measure_vramtune(url: str, tmp: Path) -> dict[str, Any]:
    """The study page on fresh servers: the first visit after each start, then later ones."""
    first, later = [], []
    for run in range(SERVER_STARTS):
        with vramtune_server(url, tmp / f"vramtune-{run}.log") as base:
            page = f"{base}/studies/{STUDY}"
            first.append(page_time(page, "vramtune", PAGE_BOUND_S, "scale-vramtune-first"))
            for _ in range(LATER_VISITS):
                later.append(page_time(page, "vramtune", PAGE_BOUND_S, "scale-vramtune"))
    with vramtune_server(url, tmp / "vramtune-settled.log") as base:
        time.sleep(SETTLED_S)  # nobody visits: the server imports the evaluators meanwhile
        settled = page_time(f"{base}/studies/{STUDY}", "vramtune", PAGE_BOUND_S, "scale-settled")
    with vramtune_server(url, tmp / "vramtune-endpoints.log") as base:
        endpoints = time_endpoints(base)  # a fresh server: every first call is computed
    return {
        "vramtune_first_visits": first,
        "vramtune_settled_first_visit": settled,
        "vramtune_later_visits": later,
        "vramtune_first_visit": medians(first),
        "vramtune_later_visit": medians(later),
        "endpoints": endpoints,
    }


def medians(visits: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each milestone's median over the visits (None if any visit missed it)."""
    out: dict[str, float | None] = {}
    for name in VRAMTUNE_MILESTONES:
        seconds = [v.get(name) for v in visits]
        out[name] = None if None in seconds else round(statistics.median(seconds), 3)
    return out


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
    parser.add_argument(
        "--skip-optuna-dashboard",
        action="store_true",
        help="keep optuna-dashboard's figure from the last results file (labelled with its date)",
    )
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
            "load_average_before": round(os.getloadavg()[0], 1),
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "code": code_version(),
        }
        results |= measure_vramtune(url, Path(tmp))
        if args.skip_optuna_dashboard:
            results["optuna_dashboard_page"] = earlier_optuna_dashboard()
        else:
            timeout = args.optuna_dashboard_timeout
            results["optuna_dashboard_page"] = measure_optuna_dashboard(
                url, study_id, Path(tmp), timeout
            ) | {"when": results["when"]}
        results["load_average_after"] = round(os.getloadavg()[0], 1)
    write_results(results)


def code_version() -> str:
    """The commit measured, and whether the working tree differed from it."""
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    changed = " with uncommitted changes in the tree" if dirty.stdout.strip() else ""
    return f"commit {commit.stdout.strip() or 'unknown'}{changed}"


def earlier_optuna_dashboard() -> dict[str, Any] | None:
    """optuna-dashboard's result in the last results file, with the date it was taken."""
    path = RESULTS / "dashboard_scale.json"
    if not path.exists():
        return None
    earlier = json.loads(path.read_text())
    found: dict[str, Any] | None = earlier.get("optuna_dashboard_page")
    if found is None:
        return None
    return found | {"when": found.get("when", earlier.get("when"))}


def write_results(results: dict[str, Any]) -> None:
    """bench/results/dashboard_scale.json and a markdown table of it."""
    (RESULTS / "dashboard_scale.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "dashboard_scale.md").write_text(markdown(results))
    print(markdown(results))


def _s(seconds: float | None, bound: float = PAGE_BOUND_S) -> str:
    return f"not within {bound:.0f} s" if seconds is None else f"{seconds:.2f} s"


def _visit_row(label: str, visit: dict[str, Any]) -> str:
    cells = [_s(visit.get(name)) for name in VRAMTUNE_MILESTONES]
    load = visit.get("load_average")
    return f"| {label} | {' | '.join(cells)} | {'' if load is None else f'{load:.1f}'} |"


def _verdict(median: dict[str, Any], visits: list[dict[str, Any]]) -> str:
    """Whether the first visit opened within TARGET_S, by the median and run by run."""
    opened = median.get("open_s")
    over = [v.get("open_s") for v in visits if v.get("open_s") is None or v["open_s"] >= TARGET_S]
    head = f"Target: the page open in under {TARGET_S:.0f} s on a first visit."
    if opened is None or opened >= TARGET_S:
        return f"{head} **Missed** by the median ({_s(opened)})."
    if not over:
        return f"{head} Met by the median ({_s(opened)}) and by every run."
    slow = ", ".join(_s(o) for o in over)
    some = f"{len(over)} of {len(visits)} runs took longer ({slow})"
    return f"{head} Met by the median ({_s(opened)}); {some}."


def _each(label: str, visits: list[dict[str, Any]]) -> list[str]:
    return [_visit_row(f"&nbsp;&nbsp;{label} {i + 1}", v) for i, v in enumerate(visits)]


def _optuna_dashboard(r: dict[str, Any]) -> str:
    found = r.get("optuna_dashboard_page")
    if found is None:
        return "not run"
    seconds = found.get("drawn_s", found.get("seconds"))  # older results named it seconds
    text = _s(seconds, found.get("timeout_s", 180.0))
    return text if found.get("when") == r["when"] else f"{text} (run of {found.get('when')})"


def markdown(r: dict[str, Any]) -> str:
    """The results as a markdown page."""
    first, later = r["vramtune_first_visit"], r["vramtune_later_visit"]
    lines = [
        f"# Dashboard at scale: a study of {r['trials']:,} trials",
        "",
        f"{r['machine']}, shared with other work: load average {r['load_average_before']:.1f}"
        f" when it began, {r['load_average_after']:.1f} when it ended; SQLite;",
        f"5 float + 1 categorical parameters, {STEPS} intermediate values per trial, vramtune's",
        f"trial records and memory observations; {r['when']}; `bench/dashboard_scale.py`"
        f" on {r.get('code', 'an unrecorded commit')}.",
        "",
        "Seconds from navigation, in headless Chromium (a new browser for every visit, so",
        "nothing is cached in the browser), until the study page is **open** (history and",
        "metric-vs-memory plots and the trial table drawn), until every plot but the importances",
        "is drawn, and until the importances arrived (the page asks for them once the rest is",
        "drawn). The load average is the machine's 1-minute load when the visit began.",
        "",
        "| visit | page open | every plot but importances | importances arrived | load |",
        "|---|---:|---:|---:|---:|",
        _visit_row(f"**first visit after a server start** (median of {SERVER_STARTS})", first),
    ]
    lines += _each("server start", r["vramtune_first_visits"])
    settled = r["vramtune_settled_first_visit"]
    lines.append(_visit_row(f"first visit {SETTLED_S:.0f} s after a server start", settled))
    n_later = len(r["vramtune_later_visits"])
    lines.append(_visit_row(f"**later visits** (median of {n_later})", later))
    lines += _each("visit", r["vramtune_later_visits"])
    lines += ["", _verdict(first, r["vramtune_first_visits"])]
    visits = [*r["vramtune_first_visits"], settled, *r["vramtune_later_visits"]]
    errors = sorted({e for v in visits for e in v.get("console_errors", [])})
    lines += [
        "",
        f"Console errors on vramtune's {len(visits)} visits: {'; '.join(errors) or 'none'}.",
        "",
        f"optuna-dashboard 0.21.0 on the same database, its study page drawn:"
        f" {_optuna_dashboard(r)}.",
        "",
        "- First visit: right after the server process answered its health check, so every",
        "  answer is computed, none cached. The importances wait for `import optuna.importance`,",
        "  which imports scikit-learn (for fANOVA, unused here) when it is installed, as in this",
        "  all-extras environment: seconds of CPU, once per process. The page no longer waits for",
        "  them: it is open before it asks. A server whose dashboard has been quiet for"
        f" {QUIET_S:.0f} s",
        "  after its start does that import in the background, so a visit that comes later gets",
        f'  its first importances without it (the row "{SETTLED_S:.0f} s after a server start":',
        "  nothing cached but the import).",
        "- Later visits: the server answers from its cache, keyed by the study's revision (a",
        "  finished study's plots and importances are computed once per server process).",
        "- optuna-dashboard: its page asks for every trial at once (one JSON of all trials) and",
        "  asks again on its 10 s timer before the first answer is drawn. Bounded wait.",
        "",
        "vramtune's JSON endpoints on this study, on another fresh server (a first call, then",
        "the best of two repeats, which the revision cache answers; the first importances call",
        "includes the import above):",
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
