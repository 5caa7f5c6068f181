"""`timm-image`: any timm classifier by name (`timm.create_model`), on upsampled digits.

Data, loss, metric and the fallback checkpointing are `worker.tasks.vision`'s; checkpointing is
timm's own `set_grad_checkpointing`. Needs ``pip install 'vramtune[vision]'``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from vramtune.worker.tasks.extras import load, require
from vramtune.worker.trial.task import Config

require("timm-image", "vision", "timm", "torchvision")

from vramtune.worker.tasks.digits import N_CLASSES  # noqa: E402
from vramtune.worker.tasks.vision import ImageTask, unknown_model, wrap_stages  # noqa: E402


class TimmImageTask(ImageTask):
    """Any timm classifier (`timm.create_model`) on upsampled digits."""

    name = "timm-image"
    library = "timm"

    def build_model(self, config: Config) -> nn.Module:
        """The named timm model, random weights, 10 classes, sized for the resolution."""
        settings = self.settings(config)
        timm = load(self.name, "vision", "timm")
        if not timm.is_model(settings.model_name):
            raise unknown_model("timm", settings.model_name, timm.list_models())
        torch.manual_seed(settings.seed)
        create = functools.partial(
            timm.create_model, settings.model_name, pretrained=False, num_classes=N_CLASSES
        )
        with _HostSchedules():
            try:
                # Vision transformers size their position embeddings from img_size.
                model: nn.Module = create(img_size=settings.resolution)
            except TypeError as error:
                if "img_size" not in str(error):
                    raise
                model = create()
        return model

    def enable_checkpointing(self, model: nn.Module) -> bool:
        """timm's own checkpointing; its stages when a model has none."""
        try:
            model.set_grad_checkpointing(True)  # type: ignore[operator]
        except (AssertionError, AttributeError, NotImplementedError):
            return wrap_stages(model) > 0
        return True

    def checkpoint_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """Not used: `enable_checkpointing` turns on timm's own."""
        return ()


class _HostSchedules(TorchFunctionMode):
    """timm's host-side schedules computed for real while a model is built under fake tensors.

    timm computes drop-path and layer-scale rates as
    ``[x.item() for x in torch.linspace(0, rate, depth, device="cpu")]`` (or ``.split(depths)``
    then ``.tolist()``) when it builds a model; under the predictor's FakeTensorMode those values
    do not exist and the build would fail. Such a `linspace` (the explicit ``device="cpu"`` marks
    timm's host computations) runs for real, and so does every later call whose tensors are all
    real: the rates are Python floats that set hyperparameters, never tensors of the model, so
    the trace counts the same storages. A real build passes through unchanged.
    """

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = (func is torch.linspace and kwargs.get("device") == "cpu") or (
            bool(tensors) and not any(isinstance(t, FakeTensor) for t in tensors)
        )
        if on_host:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)
