"""`vramtune tasks check FILE`: a user's task checked before any trial, every problem named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vramtune.worker.tasks.check_file import check_file
from vramtune.worker.tasks.members import TASK_ATTRIBUTES
from vramtune.worker.trial.task import Task

ROOT = Path(__file__).parents[2]
EXAMPLE_TASK = ROOT / "examples" / "my_task.py"
STUDY_OPTION = ("--study", str(ROOT / "examples" / "wine.yaml"))


def variant(tmp_path: Path, old: str, new: str) -> str:
    """The README's task file with one line changed, as a user's mistake."""
    source = EXAMPLE_TASK.read_text()
    assert old in source
    path = tmp_path / "their_task.py"
    path.write_text(source.replace(old, new))
    return str(path)


def test_the_readme_task_keeps_every_rule() -> None:
    # The installed command, as the README runs it.
    done = subprocess.run(
        [sys.executable, "-m", "vramtune", "tasks", "check", str(EXAMPLE_TASK), *STUDY_OPTION],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "wine-mlp:"
    assert [line.split()[0] for line in lines[1:-1]] == ["ok"] * 7
    assert lines[-1].startswith("wine-mlp: supports the rungs micro_batch, checkpointing")


def test_a_class_missing_a_member_is_named_with_the_rule_it_keeps(tmp_path: Path) -> None:
    path = variant(tmp_path, "    def evaluate(", "    def score(")
    report, code = check_file(path, study=None, config=None, device="cpu")
    assert code == 1
    assert report.startswith(f"{path}:WineTask: WineTask is not a Task: it lacks evaluate (")
    assert "evaluate is evaluate(model, config, device) -> the metric on held-out data" in report


def test_a_summed_loss_breaks_accumulation_and_says_to_return_the_mean(tmp_path: Path) -> None:
    path = variant(
        tmp_path,
        "cross_entropy(model(batch[0]), batch[1])",
        "cross_entropy(model(batch[0]), batch[1], reduction='sum')",
    )
    report, code = check_file(
        path, study=None, config='{"width": 8, "batch_size": 6}', device="cpu"
    )
    assert code == 1
    findings, rungs = report.rsplit("\n", 1)
    assert findings.splitlines()[-1].startswith("  FAIL  accumulation: loss: micro-batches changed")
    assert findings.endswith("return the batch's mean loss")
    assert rungs.startswith("wine-mlp: supports the rungs ")


def test_a_configuration_without_the_batch_parameter_stops_at_the_declarations() -> None:
    report, code = check_file(str(EXAMPLE_TASK), study=None, config='{"width": 8}', device="cpu")
    findings, _rungs = report.rsplit("\n", 1)
    assert (findings, code) == (
        "wine-mlp:\n  FAIL  declarations: batch_size_param: the configuration has no 'batch_size'",
        1,
    )


@pytest.mark.parametrize(
    ("study", "config", "message"),
    [
        (None, "[1", "--config: not JSON"),
        (None, "[1]", "--config: give a JSON object of parameter values"),
        ("no/such/study.yaml", None, "--study: no/such/study.yaml: "),
    ],
)
def test_a_bad_option_is_named_and_exits_2(
    study: str | None, config: str | None, message: str
) -> None:
    report, code = check_file(str(EXAMPLE_TASK), study=study, config=config, device="cpu")
    assert code == 2 and report.startswith(message)


def test_a_study_for_another_task_is_named(tmp_path: Path) -> None:
    report, code = check_file(
        str(EXAMPLE_TASK),
        study=str(ROOT / "examples" / "digits-mlp.yaml"),
        config=None,
        device="cpu",
    )
    assert code == 1
    assert report.endswith(
        f"the study asks for task 'digits-mlp', which {EXAMPLE_TASK} does not define"
    )


def test_the_member_table_matches_the_protocol() -> None:
    assert set(Task.__annotations__) == set(TASK_ATTRIBUTES)
