"""Image classification on scikit-learn's bundled handwritten digits, upsampled at will.

The 1,797 8x8 images ship with scikit-learn. `resolution` upsamples them (bilinear), which is
where memory grows fast: activations scale with resolution squared. Every fifth image is held
out for evaluation; the metric is accuracy (chance: 0.1).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn import functional as F

from vramtune.worker.tasks.common import parse_config
from vramtune.worker.trial.data import seeded_batches
from vramtune.worker.trial.task import Batch, Config, Metric

N_CLASSES = 10
NATIVE_RESOLUTION = 8
EVAL_EVERY_NTH = 5
HEAD_SIDE = 4


class DigitsConfig(BaseModel):
    """The tunable and fixed settings of both digits tasks."""

    # Unknown keys are an error: a misspelt parameter must not be silently ignored.
    model_config = ConfigDict(extra="forbid")

    width: int = Field(
        64, ge=1, le=65536, description="Hidden units (MLP) or first channels (CNN)."
    )
    depth: int = Field(2, ge=1, le=64, description="Hidden layers (MLP) or conv stages (CNN).")
    resolution: int = Field(8, ge=NATIVE_RESOLUTION, le=4096, description="Input side in pixels.")
    batch_size: int = Field(64, ge=1, le=10**7)
    lr: float = Field(1e-3, gt=0, le=10)
    weight_decay: float = Field(0.0, ge=0, le=10)
    seed: int = Field(0, description="Seeds the weights and the order of examples.")


@functools.cache
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test images (N, 1, 8, 8) in [0, 1] with their labels, loaded once."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    held_out = torch.arange(len(labels)) % EVAL_EVERY_NTH == 0
    return images[~held_out], labels[~held_out], images[held_out], labels[held_out]


def upsample(images: torch.Tensor, resolution: int) -> torch.Tensor:
    """Images at the configured resolution."""
    if resolution == NATIVE_RESOLUTION:
        return images
    return F.interpolate(
        images, size=(resolution, resolution), mode="bilinear", align_corners=False
    )


class _DigitsTask:
    """What the MLP and the CNN share: data, loss, optimizer and metric."""

    name: str
    batch_size_param = "batch_size"
    shape_params = frozenset({"width", "depth", "resolution"})
    metric = Metric("accuracy", "maximize")

    def settings(self, config: Config) -> DigitsConfig:
        """The validated configuration."""
        return parse_config(self.name, DigitsConfig, config)

    def build_optimizer(self, model: nn.Module, config: Config) -> torch.optim.Optimizer:
        """AdamW; foreach spelled out so CPU runs allocate what CUDA runs (and the trace) do."""
        settings = self.settings(config)
        return torch.optim.AdamW(
            model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, foreach=True
        )

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        """Random images and labels of the real batches' shapes."""
        side = self.settings(config).resolution
        images = torch.rand(micro_batch, 1, side, side, device=device)
        return images, torch.randint(0, N_CLASSES, (micro_batch,), device=device)

    def batches(
        self, config: Config, micro_batch: int, device: torch.device, seed: int
    ) -> Iterator[Batch]:
        """Training images in seeded epochs, upsampled on the device."""
        resolution = self.settings(config).resolution
        images, labels, _, _ = digits()  # loaded now, before the worker starts measuring
        return seeded_batches(
            len(labels),
            micro_batch,
            seed,
            lambda index: (
                upsample(images[index].to(device), resolution),
                labels[index].to(device),
            ),
        )

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Cross-entropy of the logits."""
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def evaluate(self, model: nn.Module, config: Config, device: torch.device) -> float:
        """Accuracy on the held-out images, in chunks of the batch size the worker passes."""
        settings = self.settings(config)
        _, _, images, labels = digits()
        correct = 0
        for start in range(0, len(labels), settings.batch_size):
            chunk = upsample(
                images[start : start + settings.batch_size].to(device), settings.resolution
            )
            predicted = model(chunk).argmax(dim=1).cpu()
            correct += int((predicted == labels[start : start + settings.batch_size]).sum())
        return correct / len(labels)

    def checkpoint_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """The hidden blocks (MLP layers or conv stages)."""
        blocks = model.get_submodule("blocks")
        assert isinstance(blocks, nn.Sequential)
        return list(blocks)


class _Classifier(nn.Module):
    """stem -> blocks (the checkpointable part) -> head."""

    def __init__(self, stem: nn.Module, blocks: nn.Sequential, head: nn.Module) -> None:
        super().__init__()
        self.stem = stem
        self.blocks = blocks
        self.head = head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        logits: torch.Tensor = self.head(self.blocks(self.stem(images)))
        return logits


class DigitsMLPTask(_DigitsTask):
    """An MLP on the flattened (upsampled) digits: `depth` hidden layers of `width` units."""

    name = "digits-mlp"

    def build_model(self, config: Config) -> nn.Module:
        """Flatten, `depth` Linear+ReLU blocks, a linear head."""
        settings = self.settings(config)
        sizes = [settings.resolution**2] + [settings.width] * settings.depth
        blocks = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(n_in, n_out), nn.ReLU())
                for n_in, n_out in itertools.pairwise(sizes)
            )
        )
        return _Classifier(nn.Flatten(), blocks, nn.Linear(settings.width, N_CLASSES))


class DigitsCNNTask(_DigitsTask):
    """A CNN: `depth` conv stages from `width` channels, doubling (up to 8x) as they pool."""

    name = "digits-cnn"

    def build_model(self, config: Config) -> nn.Module:
        """Conv-GroupNorm-ReLU stages, max-pooling while the maps are larger than 4x4."""
        settings = self.settings(config)
        stages: list[nn.Module] = []
        channels, side = 1, settings.resolution
        for stage in range(settings.depth):
            out = settings.width * 2 ** min(stage, 3)
            layers: list[nn.Module] = [
                nn.Conv2d(channels, out, kernel_size=3, padding=1, bias=False),
                # GroupNorm, not BatchNorm: its statistics are per example, so a run split into
                # micro-batches computes the same function as the run as asked.
                nn.GroupNorm(math.gcd(8, out), out),
                nn.ReLU(inplace=True),
            ]
            if side > HEAD_SIDE:
                layers.append(nn.MaxPool2d(2))
                side //= 2
            stages.append(nn.Sequential(*layers))
            channels = out
        # Pool to 4x4, not 1x1: where a stroke is tells digits apart.
        head = nn.Sequential(
            nn.AdaptiveAvgPool2d(HEAD_SIDE),
            nn.Flatten(),
            nn.Linear(channels * HEAD_SIDE**2, N_CLASSES),
        )
        return _Classifier(nn.Identity(), nn.Sequential(*stages), head)
