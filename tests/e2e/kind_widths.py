"""The PlainTask resize study's MLP (plain_widths.py) as a LightningTask and a TrainerTask, for
the study of each task kind that must resize, route or give up, never fail (issue 43): width
sets the memory, the data is random (no download), SGD keeps no optimizer state."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from vramtune import LightningTask, TrainerTask

EXAMPLES, FEATURES, CLASSES = 512, 64, 10


def mlp(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), nn.Linear(width, CLASSES))


def tensors() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(EXAMPLES, FEATURES, generator=generator)
    return inputs, torch.randint(0, CLASSES, (EXAMPLES,), generator=generator)


# ---------------------------------------------------------------- Lightning


class WidthModule(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = mlp(width)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", nn.functional.cross_entropy(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RandomData(L.LightningDataModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(*tensors()), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(*tensors()), batch_size=self.batch_size)


lightning_widths = LightningTask(
    name="lightning-widths",
    module=lambda config: WidthModule(int(config["width"])),
    datamodule=lambda config: RandomData(int(config["batch_size"])),
    monitor="val_loss",
    direction="minimize",
    shape_params=frozenset({"width"}),
)


# ---------------------------------------------------------------- Trainer


class WidthClassifier(nn.Module):
    """What a Trainer trains: keyword inputs, the loss in the output when labels are given."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = mlp(width)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(inputs)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Rows(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.inputs, self.labels = tensors()

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.inputs[index], "labels": self.labels[index]}


def trainer_kwargs() -> dict[str, Any]:
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir="unused", optim="sgd", learning_rate=0.01, per_device_eval_batch_size=256
    )
    return {
        "model_init": lambda trial: WidthClassifier(int(trial["width"])),
        "args": args,
        "train_dataset": Rows(),
        "eval_dataset": Rows(),
    }


trainer_widths = TrainerTask("trainer-widths", trainer_kwargs)
