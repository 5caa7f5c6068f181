"""vramtune: memory-aware hyperparameter tuning.

What a user touches is importable from here; every other module is internal and may change.

- Your training code as a task: ``Task`` (the full contract), ``PlainTask``, ``TrainerTask``
  (a Hugging Face ``Trainer``), ``LightningTask``, with ``Metric``, ``TaskConfigError``, the
  ``Batch`` and ``Config`` types and ``check_task`` (the contract's rules, for a user's tests).
- The service: ``Client`` (REST), ``StudySpec`` (what a study is created from), ``ApiError``.
- The predictor: ``predict``, ``largest_micro_batch``, ``Plan``, ``Prediction``.
- Will it fit?: ``fit`` (a model, a task or a Hugging Face config; one card or a rank of
  several) with ``FitResult`` and ``CardFit``;
  the card table ``CARDS`` of ``Card``, extended by ``register_card``.

Names load on first use (PEP 562), so ``import vramtune`` on a server-only install, which has
no torch, works, and ``vramtune.Client`` needs only httpx and pydantic.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("vramtune")
except PackageNotFoundError:  # a checkout run without installing
    __version__ = "0+unknown"

# public name -> the internal module that defines it
_PUBLIC: dict[str, str] = {
    "Task": "vramtune.worker.trial.task",
    "Batch": "vramtune.worker.trial.task",
    "Config": "vramtune.worker.trial.task",
    "check_task": "vramtune.worker.tasks.contract",
    "Metric": "vramtune.worker.trial.task",
    "TaskConfigError": "vramtune.worker.trial.task",
    "PlainTask": "vramtune.worker.integrations.plain",
    "TrainerTask": "vramtune.worker.integrations.hf_trainer",
    "LightningTask": "vramtune.worker.integrations.lightning",
    "Client": "vramtune.service.client",
    "ApiError": "vramtune.service.client",
    "StudySpec": "vramtune.service.wire",
    "predict": "vramtune.worker.predictor",
    "largest_micro_batch": "vramtune.worker.predictor",
    "Plan": "vramtune.service.wire",
    "Prediction": "vramtune.service.wire",
    "fit": "vramtune.worker.fit.api",
    "FitResult": "vramtune.worker.fit.api",
    "CardFit": "vramtune.worker.fit.api",
    "Card": "vramtune.worker.fit.cards",
    "CARDS": "vramtune.worker.fit.cards",
    "register_card": "vramtune.worker.fit.cards",
}
# A public name that differs from the internal one.
_ALIASES = {"StudySpec": "StudyCreate"}

__all__ = ["__version__", *sorted(_PUBLIC)]

if TYPE_CHECKING:  # the names as mypy and IDEs see them (`X as X` re-exports them)
    from vramtune.service.client import ApiError as ApiError, Client as Client
    from vramtune.service.wire import Plan as Plan, Prediction as Prediction, StudyCreate
    from vramtune.worker.fit.api import CardFit as CardFit, FitResult as FitResult, fit as fit
    from vramtune.worker.fit.cards import (
        CARDS as CARDS,
        Card as Card,
        register_card as register_card,
    )
    from vramtune.worker.integrations.hf_trainer import TrainerTask as TrainerTask
    from vramtune.worker.integrations.lightning import LightningTask as LightningTask
    from vramtune.worker.integrations.plain import PlainTask as PlainTask
    from vramtune.worker.predictor import (
        largest_micro_batch as largest_micro_batch,
        predict as predict,
    )
    from vramtune.worker.tasks.contract import check_task as check_task
    from vramtune.worker.trial.task import (
        Batch as Batch,
        Config as Config,
        Metric as Metric,
        Task as Task,
        TaskConfigError as TaskConfigError,
    )

    StudySpec = StudyCreate


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'vramtune' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), _ALIASES.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
