"""Helpers the built-in tasks share: config validation and an example-index stream."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

import torch
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from worker.task import Config, TaskConfigError

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


def index_stream(n_examples: int, micro_batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless indices into `n_examples`, epoch by epoch in a seeded random order.

    The stream of examples does not depend on `micro_batch`: micro-batches of a resized run
    concatenate to the batches of the run as asked (when the micro-batch divides the batch).
    """
    generator = torch.Generator().manual_seed(seed)
    pending = torch.empty(0, dtype=torch.long)
    while True:
        while len(pending) < micro_batch:
            pending = torch.cat([pending, torch.randperm(n_examples, generator=generator)])
        yield pending[:micro_batch]
        pending = pending[micro_batch:]
