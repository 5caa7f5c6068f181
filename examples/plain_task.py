"""The smaller contract: a digits MLP as a plain PyTorch loop would write it.

The four things memory depends on (model, optimizer, data, loss) and two declarations; batches,
the example batch the predictor traces, a chunked held-out-loss evaluation and the rest come
from PlainTask.   vramtune tasks check examples/plain_task.py --study examples/plain_task.yaml
"""

import torch
from sklearn.datasets import load_digits
from torch import nn

from vramtune import Batch, Config, PlainTask

images, labels = (torch.tensor(a) for a in load_digits(return_X_y=True))
held_out = torch.arange(len(labels)) % 5 == 0


class DigitsTask(PlainTask):
    name, shape_params = "plain-digits", frozenset({"width"})

    def build_model(self, config: Config) -> nn.Module:
        width = config["width"]
        return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))

    def build_optimizer(self, model: nn.Module, config: Config) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1))

    def data(self, config: Config) -> tuple[torch.Tensor, ...]:
        return images[~held_out].float() / 16, labels[~held_out]

    def held_out_data(self, config: Config) -> tuple[torch.Tensor, ...]:
        return images[held_out].float() / 16, labels[held_out]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch[0]), batch[1])
