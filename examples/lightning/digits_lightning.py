"""A LightningModule and a LightningDataModule as a Lightning user writes them: nothing here
knows about vramtune (tasks.py wraps them). The data is scikit-learn's bundled digits."""

import lightning as L
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class DigitsClassifier(L.LightningModule):
    def __init__(self, width: int = 128, depth: int = 2, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(64, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        accuracy = (self(images).argmax(dim=1) == labels).float().mean()
        self.log("val_acc", accuracy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class DigitsDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        images, labels = load_digits(return_X_y=True)
        images = torch.tensor(images, dtype=torch.float32) / 16.0
        labels = torch.tensor(labels)
        held_out = torch.arange(len(labels)) % 5 == 0  # every fifth image is for validation
        self.train_set = TensorDataset(images[~held_out], labels[~held_out])
        self.val_set = TensorDataset(images[held_out], labels[held_out])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)
