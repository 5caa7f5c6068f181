"""The few lines that make digits_lightning.py's unchanged classes a vramtune task.

vramtune worker --device cpu --memory-limit 64MiB --tasks examples/lightning/tasks.py
"""

from digits_lightning import DigitsClassifier, DigitsDataModule

from vramtune import LightningTask

digits_lightning = LightningTask(
    name="digits-lightning",
    module=lambda config: DigitsClassifier(config["width"], config["depth"], config["lr"]),
    # Called with the plan's micro-batch under "batch_size": Lightning accumulates the rest.
    datamodule=lambda config: DigitsDataModule(config["batch_size"]),
    monitor="val_acc",  # what validation_step logs
    direction="maximize",
    shape_params=frozenset({"width", "depth"}),
    checkpoint_modules=lambda module: list(module.net)[1:-1],  # the hidden layers
)
