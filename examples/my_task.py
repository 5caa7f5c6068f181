from collections.abc import Iterator

import torch
from sklearn.datasets import load_wine
from torch import nn

from vramtune import Batch, Config, Metric


class WineTask:  # a user's own task in one file: vramtune worker --tasks examples/my_task.py
    name, batch_size_param, shape_params = "wine-mlp", "batch_size", frozenset({"width"})
    metric = Metric("accuracy", "maximize")
    x, y = (torch.tensor(array) for array in load_wine(return_X_y=True))
    x = ((x - x.mean(0)) / x.std(0)).float()  # even rows train, odd rows are held out

    def build_model(self, config: Config) -> nn.Module:
        width = config["width"]
        return nn.Sequential(nn.Linear(13, width), nn.ReLU(), nn.Linear(width, 3))

    def build_optimizer(self, model: nn.Module, config: Config) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=config.get("lr", 0.01))

    def example_batch(self, config: Config, n: int, device: torch.device) -> Batch:
        return torch.randn(n, 13, device=device), torch.randint(0, 3, (n,), device=device)

    def batches(self, config: Config, n: int, device: torch.device, seed: int) -> Iterator[Batch]:
        generator = torch.Generator().manual_seed(seed)
        while True:
            pick = 2 * torch.randint(0, (len(self.y) + 1) // 2, (n,), generator=generator)
            yield self.x[pick].to(device), self.y[pick].to(device)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    def evaluate(self, model: nn.Module, config: Config, device: torch.device) -> float:
        return model(self.x[1::2].to(device)).argmax(1).cpu().eq(self.y[1::2]).float().mean().item()

    def checkpoint_modules(self, model: nn.Module) -> list[nn.Module]:
        return [model[0]]  # the first layer may be recomputed in backward
