"""A PlainTask without checkpointable blocks, for the PlainTask resize study (issue 43): an MLP
whose width sets its memory, on random data (no download), loaded by a worker with --tasks."""

import torch
from torch import nn

from vramtune import Batch, Config, PlainTask

EXAMPLES = 512


class PlainWidths(PlainTask):
    """Width sets the parameters (and, with the batch, the activations); no checkpoint_modules:
    plans may resize it by micro-batches only."""

    name, shape_params = "plain-widths", frozenset({"width"})
    eval_batches = 1

    def build_model(self, config: Config) -> nn.Module:
        width = int(config["width"])
        return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))

    def build_optimizer(self, model: nn.Module, config: Config) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.01)

    def data(self, config: Config) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(EXAMPLES, 64, generator=generator)
        return inputs, torch.randint(0, 10, (EXAMPLES,), generator=generator)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch[0]), batch[1])
