"""The zoo as `vramtune.worker.trial.task.Task`s, each with CPU-sized and GPU-sized
configurations."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from bench.zoo import models
from vramtune.worker.trial.task import Batch, Config, Metric

Inputs = Callable[[Config, int, torch.device], Batch]


@dataclass
class ZooTask:
    """A benchmark task: a model builder, its inputs, its loss and what may be checkpointed."""

    name: str
    builder: Callable[[Config], nn.Module]
    inputs: Inputs
    cpu: dict[str, Any]
    gpu: dict[str, Any]
    cpu_batches: tuple[int, int]
    gpu_batches: tuple[int, int]
    blocks: Callable[[nn.Module], Sequence[nn.Module]] = lambda model: ()
    loss_kind: str = "classes"
    batch_size_param: str = "batch_size"
    metric: Metric = field(default_factory=lambda: Metric("loss", "minimize"))
    shape_params: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        # Every configuration key but the batch size changes shapes here.
        self.shape_params = frozenset(self.gpu) | frozenset(self.cpu)

    def build_model(self, config: Config) -> nn.Module:
        """The architecture at the configuration's sizes."""
        return self.builder(config)

    def build_optimizer(self, model: nn.Module, config: Config) -> torch.optim.Optimizer:
        """AdamW with torch's default kernel choice (foreach on CUDA, a loop on the CPU)."""
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        """Random inputs and targets of the right shapes."""
        return self.inputs(config, micro_batch, device)

    def batches(
        self, config: Config, micro_batch: int, device: torch.device, seed: int
    ) -> Iterator[Batch]:
        """Fresh random batches on `device`."""
        torch.manual_seed(seed)
        while True:
            yield self.inputs(config, micro_batch, device)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Cross-entropy over classes, tokens or pixels; MSE for reconstructions."""
        inputs, targets = batch
        output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        if self.loss_kind == "reconstruction":
            return F.mse_loss(output, targets)
        if self.loss_kind == "tokens":
            return F.cross_entropy(output.flatten(0, 1), targets.flatten())
        return F.cross_entropy(output, targets)

    def evaluate(self, model: nn.Module, config: Config, device: torch.device) -> float:
        """Not used by the benchmark."""
        return 0.0

    def checkpoint_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """The blocks recomputed under activation checkpointing."""
        return self.blocks(model)


def _features(size: str, classes: int) -> Inputs:
    def make(config: Config, n: int, device: torch.device) -> Batch:
        x = torch.randn(n, int(config[size]), device=device)
        return x, torch.randint(0, classes, (n,), device=device)

    return make


def _images(classes: int, per_pixel: bool = False) -> Inputs:
    def make(config: Config, n: int, device: torch.device) -> Batch:
        side = int(config["resolution"])
        images = torch.randn(n, 3, side, side, device=device)
        shape = (n, side, side) if per_pixel else (n,)
        return images, torch.randint(0, classes, shape, device=device)

    return make


def _tokens(classes: int | None = None) -> Inputs:
    def make(config: Config, n: int, device: torch.device) -> Batch:
        vocab, time = int(config["vocab"]), int(config["time"])
        idx = torch.randint(0, vocab, (n, time), device=device)
        if classes is not None:
            return idx, torch.randint(0, classes, (n,), device=device)
        return idx, torch.randint(0, vocab, (n, time), device=device)

    return make


def _reconstruction(config: Config, n: int, device: torch.device) -> Batch:
    x = torch.randn(n, int(config["inputs"]), device=device)
    return x, x


def _image_and_caption(classes: int) -> Inputs:
    def make(config: Config, n: int, device: torch.device) -> Batch:
        side, vocab, time = int(config["resolution"]), int(config["vocab"]), int(config["time"])
        images = torch.randn(n, 3, side, side, device=device)
        idx = torch.randint(0, vocab, (n, time), device=device)
        return (images, idx), torch.randint(0, classes, (n,), device=device)

    return make


def _children(attribute: str) -> Callable[[nn.Module], Sequence[nn.Module]]:
    return lambda model: list(getattr(model, attribute))


ZOO: list[ZooTask] = [
    ZooTask(
        "mlp",
        lambda c: models.MLP(c["inputs"], c["width"], c["depth"], 10, 0.1),
        _features("inputs", 10),
        cpu={"inputs": 256, "width": 512, "depth": 3},
        gpu={"inputs": 1024, "width": 4096, "depth": 6},
        cpu_batches=(32, 128),
        gpu_batches=(512, 2048),
        blocks=_children("blocks"),
    ),
    ZooTask(
        "cnn-batchnorm",
        lambda c: models.ConvNet(c["width"], c["depth"], 10),
        _images(10),
        cpu={"width": 16, "depth": 3, "resolution": 32},
        gpu={"width": 64, "depth": 4, "resolution": 128},
        cpu_batches=(8, 32),
        gpu_batches=(64, 256),
        blocks=_children("stages"),
    ),
    ZooTask(
        "resnet18",
        lambda c: models.ResNet18(c["width"], 100),
        _images(100),
        cpu={"width": 8, "resolution": 32},
        gpu={"width": 64, "resolution": 224},
        cpu_batches=(4, 16),
        gpu_batches=(64, 192),
        blocks=_children("blocks"),
    ),
    ZooTask(
        "unet",
        lambda c: models.UNet(c["width"], c["depth"], 4),
        _images(4, per_pixel=True),
        cpu={"width": 8, "depth": 2, "resolution": 32},
        gpu={"width": 32, "depth": 4, "resolution": 256},
        cpu_batches=(2, 8),
        gpu_batches=(8, 32),
        blocks=lambda m: [*m.down, *m.merge],  # type: ignore[misc]
    ),
    ZooTask(
        "lstm-lm",
        lambda c: models.RNNLM("lstm", c["vocab"], c["width"], c["depth"]),
        _tokens(),
        cpu={"vocab": 512, "width": 128, "depth": 2, "time": 32},
        gpu={"vocab": 8192, "width": 1024, "depth": 2, "time": 256},
        cpu_batches=(4, 16),
        gpu_batches=(32, 96),
        loss_kind="tokens",
    ),
    ZooTask(
        "gru-lm",
        lambda c: models.RNNLM("gru", c["vocab"], c["width"], c["depth"]),
        _tokens(),
        cpu={"vocab": 512, "width": 128, "depth": 1, "time": 24},
        gpu={"vocab": 8192, "width": 1024, "depth": 2, "time": 256},
        cpu_batches=(4, 16),
        gpu_batches=(32, 96),
        loss_kind="tokens",
    ),
    ZooTask(
        "transformer-encoder",
        lambda c: models.Encoder(c["vocab"], c["width"], 8, c["depth"], 10),
        _tokens(classes=10),
        cpu={"vocab": 1000, "width": 128, "depth": 2, "time": 32},
        gpu={"vocab": 32000, "width": 512, "depth": 6, "time": 512},
        cpu_batches=(4, 16),
        gpu_batches=(32, 96),
        blocks=lambda m: list(m.encoder.layers),  # type: ignore[union-attr, arg-type]
    ),
    ZooTask(
        "gpt",
        lambda c: models.GPT(c["vocab"], c["width"], c["width"] // 64, c["depth"], c["time"], 0.0),
        _tokens(),
        cpu={"vocab": 2048, "width": 128, "depth": 2, "time": 128},
        gpu={"vocab": 50304, "width": 768, "depth": 12, "time": 512},
        cpu_batches=(2, 8),
        gpu_batches=(8, 24),
        blocks=_children("blocks"),
        loss_kind="tokens",
    ),
    ZooTask(
        "vit",
        lambda c: models.ViT(
            c["resolution"], c["patch"], c["width"], c["width"] // 64, c["depth"], 100
        ),
        _images(100),
        cpu={"resolution": 32, "patch": 4, "width": 128, "depth": 2},
        gpu={"resolution": 224, "patch": 16, "width": 768, "depth": 12},
        cpu_batches=(4, 16),
        gpu_batches=(64, 192),
        blocks=_children("blocks"),
    ),
    ZooTask(
        "tied-autoencoder",
        lambda c: models.TiedAutoencoder(c["inputs"], c["width"], c["depth"]),
        _reconstruction,
        cpu={"inputs": 512, "width": 512, "depth": 3},
        gpu={"inputs": 4096, "width": 8192, "depth": 3},
        cpu_batches=(32, 128),
        gpu_batches=(1024, 4096),
        loss_kind="reconstruction",
    ),
    ZooTask(
        "dropout-everywhere",
        lambda c: models.DropoutTransformer(
            c["vocab"], c["width"], c["width"] // 64, c["depth"], 10, 0.2
        ),
        _tokens(classes=10),
        cpu={"vocab": 1000, "width": 128, "depth": 2, "time": 128},
        gpu={"vocab": 32000, "width": 512, "depth": 6, "time": 512},
        cpu_batches=(2, 8),
        gpu_batches=(16, 48),
        blocks=_children("blocks"),
    ),
]
"""Eleven architectures; `cpu`/`gpu` hold their shape parameters for each benchmark mode."""

EXTRAS: list[ZooTask] = [
    ZooTask(
        "cnn-frozen-stages",
        lambda c: models.frozen_stages(models.ConvNet(c["width"], c["depth"], 10), trained=1),
        _images(10),
        cpu={"width": 16, "depth": 3, "resolution": 32},
        gpu={"width": 64, "depth": 4, "resolution": 128},
        cpu_batches=(8, 32),
        gpu_batches=(64, 256),
    ),
    ZooTask(
        "gpt-lora",
        lambda c: models.with_lora(
            models.GPT(c["vocab"], c["width"], c["width"] // 64, c["depth"], c["time"], 0.0),
            rank=8,
            targets=["qkv", "proj", "fc", "out"],
        ),
        _tokens(),
        cpu={"vocab": 2048, "width": 128, "depth": 2, "time": 128},
        gpu={"vocab": 50304, "width": 768, "depth": 12, "time": 512},
        cpu_batches=(2, 8),
        gpu_batches=(8, 24),
        loss_kind="tokens",
    ),
    ZooTask(
        "two-inputs",
        lambda c: models.TwoInputs(c["vocab"], c["width"], 10),
        _image_and_caption(10),
        cpu={"width": 16, "resolution": 32, "vocab": 1000, "time": 32},
        gpu={"width": 64, "resolution": 128, "vocab": 32000, "time": 256},
        cpu_batches=(8, 32),
        gpu_batches=(64, 256),
    ),
]
"""What the zoo leaves to other benchmarks: frozen stages (BatchNorm still updating), peft's
LoRA on the GPT (its tied embedding frozen with the base; needs the [peft] extra) and a model
of two inputs (an image and a caption). Kept out of `ZOO` so predictor_accuracy's cases stay
as they are."""
