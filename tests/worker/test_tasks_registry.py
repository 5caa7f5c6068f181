"""Task discovery: entry points, --tasks modules and files, and tasks that fail to load."""

from __future__ import annotations

import textwrap
from pathlib import Path

from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.members import TASK_METHODS
from vramtune.worker.tasks.registry import _protocol_methods, discover, format_listing
from vramtune.worker.trial.task import Task

BUILT_INS = {"digits-mlp", "digits-cnn", "char-transformer"}

RUNNER_SOURCE = """
from vramtune.service.wire import Prediction

class EchoRunner:
    task_name, can_checkpoint, can_bf16 = "echo", False, False

    def batch_size(self, config):
        return 1

    def predict(self, config, plan, card):
        return Prediction(peak_allocated_bytes=0, peak_reserved_bytes=0)

    def run(self, config, plan, budget, card, reporter):
        raise NotImplementedError
"""


def write(folder: Path, name: str, source: str) -> str:
    """A module file in `folder`; returns its path as --tasks takes it."""
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_the_installed_entry_points_give_the_built_in_tasks_wrapped_in_the_torch_loop() -> None:
    found = discover()
    assert found.runners.keys() >= BUILT_INS
    for name in BUILT_INS:
        runner = found.runners[name]
        assert isinstance(runner, TorchTaskRunner) and runner.task.name == name
        assert runner.can_checkpoint and runner.can_bf16
    assert found.sources["digits-cnn"] == "vramtune.worker.tasks.digits:DigitsCNNTask"


def test_a_task_file_loads_beside_the_entry_points() -> None:
    example = Path(__file__).parents[2] / "examples" / "my_task.py"
    found = discover([str(example)])
    assert {"wine-mlp", *BUILT_INS} <= found.runners.keys()
    assert found.sources["wine-mlp"] == f"{example}:WineTask"


def test_a_dotted_module_name_loads_its_task_classes() -> None:
    found = discover(["vramtune.worker.tasks.digits"], entry_points=False)
    assert found.runners.keys() == {"digits-mlp", "digits-cnn"}
    assert not found.errors


def test_a_broken_task_is_reported_by_name_and_the_others_still_load(tmp_path: Path) -> None:
    broken = write(tmp_path, "broken_task.py", "import no_such_package_here\n")
    found = discover([broken, "no.such.module", str(tmp_path / "missing.py")])
    assert found.runners.keys() >= BUILT_INS
    assert found.errors[broken] == "ModuleNotFoundError: No module named 'no_such_package_here'"
    assert found.errors["no.such.module"].startswith("ModuleNotFoundError")
    assert found.errors[str(tmp_path / "missing.py")].startswith("FileNotFoundError")


def test_a_runner_is_used_as_is(tmp_path: Path) -> None:
    found = discover([write(tmp_path, "echo_runner.py", RUNNER_SOURCE)], entry_points=False)
    assert type(found.runners["echo"]).__name__ == "EchoRunner"


def test_a_class_and_its_instance_are_one_task_but_two_classes_with_one_name_conflict(
    tmp_path: Path,
) -> None:
    first = write(tmp_path, "echo_one.py", RUNNER_SOURCE + "\nECHO = EchoRunner()\n")
    second = write(tmp_path, "echo_two.py", RUNNER_SOURCE)
    found = discover([first, second], entry_points=False)
    assert list(found.runners) == ["echo"]
    assert found.sources["echo"] in {f"{first}:EchoRunner", f"{first}:ECHO"}
    assert f"{second}:EchoRunner also defines 'echo'" in found.errors["echo"]


def test_a_bad_name_a_failing_constructor_and_an_empty_module_are_errors(tmp_path: Path) -> None:
    bad_name = write(tmp_path, "bad_name.py", RUNNER_SOURCE.replace('"echo"', '"no spaces"'))
    failing = write(
        tmp_path,
        "failing.py",
        RUNNER_SOURCE + "\n    def __init__(self):\n        raise RuntimeError('needs a GPU')\n",
    )
    empty = write(tmp_path, "empty.py", "VALUE = 1\n")
    found = discover([bad_name, failing, empty], entry_points=False)
    assert not found.runners
    assert "invalid task name 'no spaces'" in found.errors[f"{bad_name}:EchoRunner"]
    assert found.errors[f"{failing}:EchoRunner"] == "RuntimeError: needs a GPU"
    assert found.errors[empty].startswith(f"no Task or TrialRunner found in {empty}: a task is")


def test_the_listing_shows_each_task_and_each_failure(tmp_path: Path) -> None:
    broken = write(tmp_path, "broken_listing.py", "raise ValueError('bad file')\n")
    listing = format_listing(discover([broken]))
    lines = listing.splitlines()
    assert lines[0].split() == ["TASK", "METRIC", "BATCH", "SHAPE", "PARAMS", "SOURCE"]
    (cnn,) = [line for line in lines if line.startswith("digits-cnn ")]
    assert cnn.split() == [
        "digits-cnn",
        "accuracy",
        "(maximize)",
        "batch_size",
        "depth,resolution,width",
        "vramtune.worker.tasks.digits:DigitsCNNTask",
    ]
    assert lines[-2:] == ["failed to load:", f"  {broken}: ValueError: bad file"]


def test_the_registry_knows_the_task_protocol_methods_without_importing_torch() -> None:
    assert _protocol_methods(Task) == frozenset(TASK_METHODS)
