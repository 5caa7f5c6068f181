"""deploy/slurm/vramtune-workers.sbatch: checked as a script, and run by a real Slurm.

The real run needs Debian's slurm-wlm and munge (scripts/setup.sh installs them) and root:
this module starts its own munged, slurmctld and slurmd (one node, loopback, its own ports and
files) and submits the script with a one-minute time limit. Cost: ~1-2 minutes, most of it
waiting for Slurm's time-limit signal.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    FAST_FLEET,
    PATIENCE_S,
    REPO,
    SMALL,
    Studies,
)
from vramtune.service.testing import (
    ServerProcess,
    free_port,
    server_factory,
    sqlite_url,
    upgrade_database,
)

SCRIPT = REPO / "deploy" / "slurm" / "vramtune-workers.sbatch"
X = {"x": {"type": "float", "low": -2.0, "high": 2.0}}
# A trial far longer than the test: the worker is in the middle of it when the signal comes.
LONG = {"task_config": {"step_seconds": 0.1}, "budget": {"max_steps": 5000, "eval_every": 100}}


def directives() -> dict[str, str]:
    """The script's #SBATCH options, by name."""
    found = re.findall(r"^#SBATCH --([a-z-]+)=(\S+)$", SCRIPT.read_text(), flags=re.M)
    return dict(found)


def test_the_script_is_valid_bash_with_the_directives_it_needs() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    options = directives()
    assert options["gres"] == "gpu:1", "one card per array task"
    kind, seconds = re.fullmatch(r"(B:)?TERM@(\d+)", options["signal"]).groups()  # type: ignore[union-attr]
    assert kind == "B:", "the signal goes to the batch script, which is the worker (exec)"
    assert int(seconds) >= 60, "time for the worker to finish its step and hand back"
    assert re.search(r"^exec vramtune worker ", SCRIPT.read_text(), flags=re.M)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One SQLite server for the module (the database is not what this module tests)."""
    directory = tmp_path_factory.mktemp("slurm-server")
    url = upgrade_database(sqlite_url(directory))
    with server_factory(directory) as start:
        yield start(url, **FAST_FLEET)


@pytest.fixture
def studies(server: ServerProcess) -> Iterator[Studies]:
    from vramtune.service.client import Client

    with Client(server.url) as client:
        made = Studies(client)
        yield made
        made.cleanup()


def worker_env(server: ServerProcess) -> dict[str, str]:
    """What a user exports before sbatch: the server, a simulated card, vramtune on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return {
        **os.environ,
        "PATH": path,
        "PYTHONUNBUFFERED": "1",
        "VRAMTUNE_SERVER": server.url,
        "VRAMTUNE_DEVICE": "cpu",
        "VRAMTUNE_MEMORY_LIMIT": SMALL,
    }


QUADRATIC_ONLY = [
    "--tasks",
    "vramtune.worker.tasks.quadratic",
    "--no-entry-points",
    "--poll",
    "0.1",
]


def test_the_worker_the_script_starts_hands_back_on_sigterm(
    server: ServerProcess, studies: Studies, tmp_path: Path
) -> None:
    name = studies.create(X, n_trials=1, **LONG)
    log = tmp_path / "job.log"
    with log.open("wb") as out:
        job = subprocess.Popen(
            ["bash", str(SCRIPT), *QUADRATIC_ONLY],
            env=worker_env(server),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        studies.wait_until(name, lambda trials: any(t.state == "RUNNING" for t in trials))
        job.send_signal(signal.SIGTERM)  # what Slurm sends at --signal=B:TERM@N
        assert job.wait(PATIENCE_S) == 0, log.read_text()
    finally:
        if job.poll() is None:
            job.kill()
    _assert_handed_back(studies, name, log.read_text())


def _assert_handed_back(studies: Studies, name: str, log: str) -> None:
    [trial] = studies.trials(name)
    assert trial.state not in {"COMPLETE", "FAIL"}, "handed back: waiting to be re-offered"
    assert '"kind": "interrupted"' in log, log[-3000:]
    assert '"event": "stopped"' in log


class Slurm:
    """munged, slurmctld and slurmd of this module: one node, loopback, files in `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.conf = {"SLURM_CONF": str(root / "slurm.conf")}
        self.env = {**os.environ, **self.conf}
        self.pids: list[int] = []

    def start(self) -> None:
        """Write the config, start the daemons, wait until the node is idle."""
        (self.root / "state").mkdir()
        (self.root / "spool").mkdir()
        socket_path = self.root / "munge.socket"
        ctld, slurmd = free_port(), free_port()
        (self.root / "slurm.conf").write_text(
            SLURM_CONF.format(
                root=self.root, socket=socket_path, node=self.node, ctld=ctld, slurmd=slurmd
            )
        )
        munged = ["munged", "--force", f"--socket={socket_path}"]
        munged += [f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log"]
        munged += [f"--seed-file={self.root}/munge.seed"]
        subprocess.run(munged, check=True, timeout=30)
        self.pids.append(int((self.root / "munged.pid").read_text()))
        subprocess.run(["slurmctld"], env=self.env, check=True, timeout=30)
        self._wait_for_pid("slurmctld.pid")
        subprocess.run(["slurmd", "-N", self.node], env=self.env, check=True, timeout=30)
        self._wait_for_pid("slurmd.pid")
        deadline = time.monotonic() + PATIENCE_S
        while "idle" not in self.run("sinfo", "-h", "-o", "%T"):
            if time.monotonic() > deadline:
                pytest.fail(f"the Slurm node never became idle:\n{self.logs()}")
            time.sleep(0.5)

    def run(self, *command: str) -> str:
        """A Slurm client command against this cluster; its output."""
        result = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=60, check=False
        )
        return result.stdout + result.stderr

    def logs(self) -> str:
        """The daemons' logs."""
        return "\n".join(p.read_text() for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        """Cancel this cluster's jobs (a failed test may leave one), then end the daemons this
        module started, by their pids."""
        self.run("scancel", "--full", "--user=root")
        deadline = time.monotonic() + 30
        while self.run("squeue", "-h").strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in reversed(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        time.sleep(1)

    def _wait_for_pid(self, name: str) -> None:
        deadline = time.monotonic() + 30
        while not (self.root / name).exists() or not (self.root / name).read_text().strip():
            if time.monotonic() > deadline:
                pytest.fail(f"{name} never appeared:\n{self.logs()}")
            time.sleep(0.2)
        self.pids.append(int((self.root / name).read_text()))


SLURM_CONF = """\
ClusterName=vramtune-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={socket}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait=30
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    """A one-node Slurm cluster of the module's own (root and Debian's slurm-wlm needed)."""
    missing = [d for d in ("munged", "slurmctld", "slurmd", "sbatch") if not shutil.which(d)]
    if missing:
        pytest.skip(f"no {', '.join(missing)}: scripts/setup.sh installs slurm-wlm and munge")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs as root")
    cluster = Slurm(Path(tempfile.mkdtemp(prefix="vt-slurm-")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


def test_a_slurm_job_hands_its_trial_back_at_the_end_of_its_allocation(
    slurm: Slurm, server: ServerProcess, studies: Studies, tmp_path: Path
) -> None:
    name = studies.create(X, n_trials=1, **LONG)
    log = tmp_path / "job.log"
    # The script as a user submits it, on this node's terms: no GPU, one CPU, and a one-minute
    # allocation whose early signal (45 s before the end) comes while the trial runs.
    submit = ["sbatch", "--parsable", "--time=1", "--signal=B:TERM@45", "--gres=none"]
    submit += ["--cpus-per-task=1", f"--output={log}", str(SCRIPT), *QUADRATIC_ONLY]
    result = subprocess.run(
        submit, env=worker_env(server) | slurm.conf, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr + slurm.logs()
    job = result.stdout.strip().split(";")[0]
    deadline = time.monotonic() + PATIENCE_S
    while not any(t.state == "RUNNING" for t in studies.trials(name)):
        state = slurm.run("scontrol", "show", "job", job)
        if time.monotonic() > deadline or "JobState=FAILED" in state:
            text = log.read_text() if log.exists() else "(no job log)"
            pytest.fail(f"job {job} never ran the trial: {state}\n{text[-4000:]}")
        time.sleep(0.5)
    deadline = time.monotonic() + 150
    while "JobState=COMPLETED" not in (state := slurm.run("scontrol", "show", "job", job)):
        if time.monotonic() > deadline or re.search(r"JobState=(FAILED|TIMEOUT|CANCELLED)", state):
            pytest.fail(f"job {job}: {state}\n{log.read_text()}\n{slurm.logs()[-4000:]}")
        time.sleep(1)
    assert "ExitCode=0:0" in state, "the worker exited 0, before the time limit's SIGKILL"
    _assert_handed_back(studies, name, log.read_text())
