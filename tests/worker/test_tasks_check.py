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
LIGHTNING = ROOT / "examples" / "lightning"
TRAINER = ROOT / "examples" / "hf_trainer"
RUNNER_STAGES = ["declarations", "trace", "train and evaluate", "resize"]


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


def stages(report: str) -> list[tuple[str, str, str]]:
    """(mark, stage, what it said) per line of one task's findings."""
    found = []
    for line in report.splitlines()[1:-1]:  # the task's name above, its rungs below
        mark, rest = line.split(None, 1)
        stage, _, said = rest.partition(": ")
        found.append((mark, stage, said))
    return found


@pytest.mark.parametrize(
    ("tasks", "study"),
    [(LIGHTNING / "tasks.py", LIGHTNING / "digits-lightning.yaml"), (TRAINER / "tasks.py", None)],
    ids=["lightning", "hf-trainer"],
)
def test_a_task_that_runs_trials_itself_runs_its_real_path(tasks: Path, study: Path | None) -> None:
    if study is None:
        pytest.importorskip("transformers")
        study = TRAINER / "study.yaml"
    report, code = check_file(str(tasks), study=str(study), config=None, device="cpu")
    assert code == 0, report
    found = stages(report)
    assert [(mark, stage) for mark, stage, _ in found] == [("ok", s) for s in RUNNER_STAGES]
    # The trained runs measured what the traces predicted, as asked and resized (on the CPU,
    # byte for byte).
    for _, stage, said in found[2:]:
        measured = said.split("measured ")[1].split(" (predicted ")
        assert measured[0] == measured[1].split(")")[0], (stage, said)
    assert report.splitlines()[-1].endswith("supports the rungs micro_batch, checkpointing, bf16")


def test_a_runner_without_its_batch_parameter_stops_at_the_declarations() -> None:
    config = '{"width": 8, "depth": 2, "lr": 0.001}'
    report, code = check_file(str(LIGHTNING / "tasks.py"), study=None, config=config, device="cpu")
    assert code == 1
    assert stages(report) == [
        ("FAIL", "declarations", "digits-lightning: batch_size: missing from the config")
    ]


def test_a_runner_whose_own_code_raises_is_named_at_its_stage(tmp_path: Path) -> None:
    path = tmp_path / "broken_lightning.py"
    path.write_text(
        f"""import sys
sys.path.insert(0, {str(LIGHTNING)!r})
from digits_lightning import DigitsClassifier, DigitsDataModule
from vramtune import LightningTask


class Broken(DigitsClassifier):
    def training_step(self, batch, batch_idx):
        raise ValueError("the loss went missing")


broken = LightningTask(
    name="broken",
    module=lambda c: Broken(c["width"], c["depth"], c["lr"]),
    datamodule=lambda c: DigitsDataModule(c["batch_size"]),
    monitor="val_acc",
    direction="maximize",
    shape_params=frozenset({{"width", "depth"}}),
)
"""
    )
    config = '{"width": 8, "depth": 2, "lr": 0.001, "batch_size": 4}'
    report, code = check_file(str(path), study=None, config=config, device="cpu")
    assert code == 1
    *kept, (mark, stage, said) = stages(report)
    assert [m for m, _, _ in kept] == ["ok"] * len(kept)
    assert (mark, stage) == ("FAIL", RUNNER_STAGES[len(kept)])
    assert said.endswith("ValueError: the loss went missing"), report
