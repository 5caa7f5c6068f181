"""Helpers the built-in tasks share: config validation (the seeded stream of batches is
`vramtune.worker.trial.data.seeded_batches`, which integrations share too)."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from vramtune.worker.trial.task import Config, TaskConfigError

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
