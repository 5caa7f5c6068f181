"""The example studies: valid study bodies whose spaces hold trials too big for a small card."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from task_contract import run_trial

from vramtune.service.wire import CategoricalParam, StudyCreate
from vramtune.worker.run.training import TorchTaskRunner, trial_config
from vramtune.worker.tasks.registry import discover
from vramtune.worker.trial.runner import OutOfMemory

STUDIES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
BUILT_IN = {
    "digits-mlp",
    "digits-cnn",
    "char-transformer",
    "hf-causal-lm",
    "timm-image",
    "torchvision-image",
}
# Studies of users' own code (tests/e2e/test_own_code.py): wine.yaml tunes examples/my_task.py,
# plain_task.yaml the smaller contract's example, the README's (tests/deploy/test_demo.py).
OWN_CODE = {"wine-mlp", "plain-digits"}
SMALL_CARD = 256 * 1024**2


def study(path: Path) -> StudyCreate:
    """An example file as the service would take it."""
    return StudyCreate.model_validate(yaml.safe_load(path.read_text()))


def corner(spec: StudyCreate, largest: bool) -> dict[str, Any]:
    """The configuration at the high (or low) end of every parameter, over the task_config."""
    params: dict[str, Any] = {}
    for name, param in spec.search_space.items():
        if isinstance(param, CategoricalParam):
            choices = [c for c in param.choices if isinstance(c, int | float)]
            if not choices:  # names (model_name, model_type): listed smallest first
                choices = [param.choices[-1] if largest else param.choices[0]]
            params[name] = max(choices) if largest else min(choices)
        else:
            params[name] = param.high if largest else param.low
    return trial_config(spec.task_config, params)


def runner_for(spec: StudyCreate) -> TorchTaskRunner:
    """The built-in runner the study names."""
    found = discover()
    if spec.task in found.unavailable:
        pytest.skip(found.unavailable[spec.task])
    runner = found.runners[spec.task]
    assert isinstance(runner, TorchTaskRunner)
    return runner


def test_there_is_an_example_study_per_built_in_task() -> None:
    assert {study(path).task for path in STUDIES} == BUILT_IN | OWN_CODE


EXAMPLES = [path for path in STUDIES if study(path).task in BUILT_IN]


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_the_smallest_corner_trains_on_a_256_mib_card(path: Path) -> None:
    spec = study(path)
    result = run_trial(
        runner_for(spec).task, corner(spec, largest=False), steps=1, limit_bytes=SMALL_CARD
    )
    assert result.measured.peak_allocated_bytes < SMALL_CARD


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_the_largest_corner_does_not_fit_a_256_mib_card(path: Path) -> None:
    spec = study(path)
    with pytest.raises(OutOfMemory) as oom:
        run_trial(
            runner_for(spec).task, corner(spec, largest=True), steps=1, limit_bytes=SMALL_CARD
        )
    assert oom.value.measured.peak_allocated_bytes <= SMALL_CARD
