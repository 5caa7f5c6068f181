"""`torchvision-image` (and what `timm-image` shares): a classifier by name, on digits.

`model_name` is a hyperparameter like any other (a categorical choice in the study's search
space); the model is built with random weights (``pretrained=False`` / ``weights=None``) and 10
classes, nothing downloaded. The data are scikit-learn's bundled 8x8 handwritten digits,
upsampled (bilinear) to `resolution`, the shape parameter that drives memory, and repeated to
three channels; every fifth image is held out and the metric is accuracy (chance 0.1).
Checkpointing is timm's own `set_grad_checkpointing`; torchvision has none, so its models'
stages (`features`, `layer1..4`, the encoder's layers) are recomputed instead.

Both need ``pip install 'vramtune[vision]'`` (timm imports torchvision): a torchvision built for
the installed torch (see README).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedFakeTensorException,
)
from torch.nn import functional as F

from vramtune.common.task_rules import MIN_RESOLUTION, image_problems
from vramtune.worker.tasks.common import parse_config
from vramtune.worker.tasks.digits import N_CLASSES, digits, upsample
from vramtune.worker.tasks.extras import load, require
from vramtune.worker.trial.data import seeded_batches
from vramtune.worker.trial.task import Batch, Config, Metric, TaskConfigError

require("torchvision-image", "vision", "torchvision")
load("torchvision-image", "vision", "torchvision")  # one built for another torch fails here

# Errors of a forward that are the trace's, not the configuration's: they must stay as they are
# (the predictor falls back to a probe; the trainer reports an OOM).
_NOT_A_SHAPE_ERROR = (
    torch.OutOfMemoryError,
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedFakeTensorException,
)


class ImageConfig(BaseModel):
    """The tunable and fixed settings of both image tasks."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field("resnet18", description="A classification model of the library.")
    resolution: int = Field(32, ge=MIN_RESOLUTION, le=2048, description="Input side in pixels.")
    batch_size: int = Field(32, ge=1, le=10**7)
    lr: float = Field(1e-3, gt=0, le=10)
    weight_decay: float = Field(0.05, ge=0, le=10)
    seed: int = Field(0, description="Seeds the weights and the order of examples.")

    @model_validator(mode="after")
    def _buildable(self) -> ImageConfig:
        for field, message in image_problems(self.model_dump()):
            raise ValueError(f"{field}: {message}")
        return self


def unknown_model(library: str, name: str, known: Sequence[str]) -> TaskConfigError:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return TaskConfigError(f"model_name: {library} has no classification model {name!r}{hint}")


class ImageTask:
    """What the two libraries' tasks share: data, optimizer, loss, metric."""

    name: str
    library: str
    batch_size_param = "batch_size"
    shape_params = frozenset({"model_name", "resolution"})
    metric = Metric("accuracy", "maximize")

    def settings(self, config: Config) -> ImageConfig:
        """The validated configuration."""
        return parse_config(self.name, ImageConfig, config)

    def build_optimizer(self, model: nn.Module, config: Config) -> torch.optim.Optimizer:
        """AdamW; foreach spelled out so CPU runs allocate what CUDA runs (and the trace) do."""
        settings = self.settings(config)
        return torch.optim.AdamW(
            model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, foreach=True
        )

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        """Random RGB images and labels of the real batches' shapes."""
        side = self.settings(config).resolution
        images = torch.rand(micro_batch, 3, side, side, device=device)
        return images, torch.randint(0, N_CLASSES, (micro_batch,), device=device)

    def batches(
        self, config: Config, micro_batch: int, device: torch.device, seed: int
    ) -> Iterator[Batch]:
        """Training digits in seeded epochs, upsampled and made RGB on the device."""
        resolution = self.settings(config).resolution
        images, labels, _, _ = digits()  # loaded now, before the worker starts measuring
        return seeded_batches(
            len(labels),
            micro_batch,
            seed,
            lambda index: (rgb(images[index].to(device), resolution), labels[index].to(device)),
        )

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Cross-entropy of the logits (a model with auxiliary heads: of its main head)."""
        images, labels = batch
        return F.cross_entropy(self._logits(model, images), labels)

    def _logits(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        try:
            out = model(images)
        except _NOT_A_SHAPE_ERROR:
            raise
        except RuntimeError as error:  # a conv or patch larger than what is left of the image
            first = str(error).strip().splitlines()[0][:300]
            raise TaskConfigError(
                f"resolution: {self.library} model cannot run on {tuple(images.shape[1:])} "
                f"images ({first}); use a larger resolution"
            ) from error
        # torchvision's GoogLeNet and Inception return their auxiliary logits in training.
        if isinstance(out, tuple):
            out = getattr(out, "logits", out[0])
        logits: torch.Tensor = out
        return logits

    def evaluate(self, model: nn.Module, config: Config, device: torch.device) -> float:
        """Accuracy on the held-out digits, in chunks of the batch size."""
        settings = self.settings(config)
        _, _, images, labels = digits()
        correct = 0
        for start in range(0, len(labels), settings.batch_size):
            chunk = images[start : start + settings.batch_size].to(device)
            logits = self._logits(model, rgb(chunk, settings.resolution))
            correct += int((logits.argmax(dim=1).cpu() == labels[start : start + len(chunk)]).sum())
        return correct / len(labels)


def rgb(images: torch.Tensor, resolution: int) -> torch.Tensor:
    """Grey digits at `resolution`, repeated to three channels (a real, not an expanded, copy:
    the trace's batch is a plain (n, 3, side, side) tensor)."""
    return upsample(images, resolution).repeat(1, 3, 1, 1)


class TorchvisionImageTask(ImageTask):
    """Any torchvision classification model (`torchvision.models.get_model`) on upsampled digits."""

    name = "torchvision-image"
    library = "torchvision"

    def build_model(self, config: Config) -> nn.Module:
        """The named torchvision classifier, random weights, 10 classes."""
        settings = self.settings(config)
        models = load(self.name, "vision", "torchvision.models")
        known = models.list_models(module=models)  # classification models only
        if settings.model_name not in known:
            raise unknown_model("torchvision", settings.model_name, known)
        torch.manual_seed(settings.seed)
        extra: dict[str, Any] = {}
        if settings.model_name.startswith("vit_"):
            extra["image_size"] = settings.resolution
        if settings.model_name in ("googlenet", "inception_v3"):
            extra["init_weights"] = True
        model: nn.Module = models.get_model(
            settings.model_name, weights=None, num_classes=N_CLASSES, **extra
        )
        return model

    def checkpoint_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """The model's stages."""
        return stages(model)


def stages(model: nn.Module) -> list[nn.Module]:
    """The blocks worth recomputing: `features`' children, ResNet's layers, a ViT's encoder
    layers, else the top-level children that hold parameters (the head excepted)."""
    for path in ("features", "encoder.layers", "trunk_output"):
        try:
            found = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(found, nn.Sequential | nn.ModuleList) and len(found) > 1:
            return list(found)
    layers = [getattr(model, f"layer{i}") for i in range(1, 5) if hasattr(model, f"layer{i}")]
    if layers:
        return layers
    children = [c for c in model.children() if any(True for _ in c.parameters())]
    return children[:-1]


def wrap_stages(model: nn.Module) -> int:
    """Checkpoint `stages(model)` the way the trainer checkpoints a task's modules."""
    from vramtune.worker.trial.steps import checkpoint_forward

    blocks = stages(model)
    for block in blocks:
        checkpoint_forward(block)
    return len(blocks)
