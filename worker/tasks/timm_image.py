"""`timm-image`: any timm classifier by name (`timm.create_model`), on upsampled digits.

Data, loss, metric and the fallback checkpointing are `worker.tasks.vision`'s; checkpointing is
timm's own `set_grad_checkpointing`. Needs ``pip install 'vramtune[vision]'``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from worker.task import Config
from worker.tasks.extras import load, require

require("timm-image", "vision", "timm", "torchvision")

from worker.tasks.digits import N_CLASSES  # noqa: E402
from worker.tasks.vision import ImageTask, unknown_model, wrap_stages  # noqa: E402


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
    """`torch.linspace` as a host array while a timm model is built, even under fake tensors.

    timm computes its drop-path and layer-scale schedules as
    ``[x.item() for x in torch.linspace(0, rate, depth)]`` when it builds a model; under the
    predictor's FakeTensorMode the values do not exist and the build would fail. They are a few
    Python floats that only set hyperparameters, never tensors of the model, so computing them
    for real changes no memory the trace counts.
    """

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.linspace:
            # numpy's answers `.item()`, `.tolist()`, iteration and indexing as the tensor
            # would, without a dispatch the fake mode refuses.
            start, end, steps = args[:3] if len(args) >= 3 else (*args, (kwargs or {})["steps"])
            return numpy.linspace(float(start), float(end), int(steps))
        return func(*args, **(kwargs or {}))
