"""Helpers the built-in tasks share: config validation and a seeded stream of batches."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from worker.task import Batch, Config, TaskConfigError

ConfigModel = TypeVar("ConfigModel", bound=BaseModel)


def parse_config(task_name: str, model: type[ConfigModel], config: Config) -> ConfigModel:
    """Validate a configuration, turning pydantic's errors into one TaskConfigError."""
    try:
        return model.model_validate(dict(config))
    except ValidationError as error:
        problems = "; ".join(_describe(issue) for issue in error.errors())
        raise TaskConfigError(f"{task_name}: {problems}") from None


def _describe(issue: ErrorDetails) -> str:
    """One validation problem as 'field: message' (the model's own checks name no field)."""
    message = issue["msg"].removeprefix("Value error, ")
    field = ".".join(str(part) for part in issue["loc"])
    return f"{field}: {message}" if field else message


def seeded_batches(
    n_examples: int, micro_batch: int, seed: int, make_batch: Callable[[torch.Tensor], Batch]
) -> Iterator[Batch]:
    """Endless `make_batch(indices)` over `n_examples`, epoch by epoch in a seeded order.

    The stream of examples does not depend on `micro_batch`: micro-batches of a resized run
    concatenate to the batches of the run as asked (when the micro-batch divides the batch).
    The order is kept in Python lists and each index tensor dies with its call, so no tensor
    but the batch itself is alive during a step: the trace, which sees only the batch, matches.
    """
    order = random.Random(seed)
    pending: list[int] = []
    while True:
        while len(pending) < micro_batch:
            epoch = list(range(n_examples))
            order.shuffle(epoch)
            pending += epoch
        yield make_batch(torch.tensor(pending[:micro_batch]))
        del pending[:micro_batch]
