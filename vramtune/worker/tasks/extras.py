"""Built-in tasks that need an optional dependency (``pip install 'vramtune[hf]'``, ``[vision]``).

Their modules call `require` at import: without the library the import raises `MissingExtra`,
and the registry leaves the task out of what the worker advertises (listing it as not
installed) instead of reporting a broken plugin. The check only looks the library up (no
import: transformers alone takes seconds to import, and every worker start would pay it); the
library itself is imported when a trial first builds a model, and a broken install then fails
that trial with the import error.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from torch.utils._python_dispatch import _disable_current_modes


class MissingExtra(ImportError):
    """A built-in task's optional dependency is not installed."""


def require(task: str, extra: str, *modules: str) -> None:
    """Raise MissingExtra naming the extra unless every module in `modules` is installed."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtra(f"{task} needs {', '.join(missing)}: pip install 'vramtune[{extra}]'")


def load(task: str, extra: str, module: str) -> ModuleType:
    """Import `module` for `task`, naming the extra when it fails.

    The import runs outside any torch dispatch mode: a first import inside the predictor's
    trace would otherwise count the tensors the library makes at import (peft's: 1 KiB) as the
    model's.
    """
    try:
        with _disable_current_modes():
            return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtra(
            f"{task} cannot import {module} ({error}); see vramtune[{extra}]"
        ) from error
