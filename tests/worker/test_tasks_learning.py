"""Each built-in task learns: a short CPU run through the worker's loop beats chance clearly."""

from __future__ import annotations

import math

from task_contract import run_trial

from vramtune.worker.tasks.charlm import VOCAB, CharTransformerTask
from vramtune.worker.tasks.digits import N_CLASSES, DigitsCNNTask, DigitsMLPTask

DIGITS_CHANCE = 1 / N_CLASSES


def test_digits_mlp_learns() -> None:
    config = {"width": 64, "depth": 2, "batch_size": 32, "lr": 1e-2}
    result = run_trial(DigitsMLPTask(), config, steps=40)
    assert result.values[0] > DIGITS_CHANCE + 0.6  # chance is 0.1; 40 steps reach ~0.9


def test_digits_cnn_learns() -> None:
    config = {"width": 8, "depth": 2, "batch_size": 32, "lr": 1e-2}
    result = run_trial(DigitsCNNTask(), config, steps=30)
    assert result.values[0] > DIGITS_CHANCE + 0.6


def test_char_transformer_learns() -> None:
    config = {"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 32, "batch_size": 16}
    result = run_trial(CharTransformerTask(), {**config, "lr": 3e-3}, steps=40)
    # A uniform guess costs ln(128) = 4.85 nats per character; Python source is far from random.
    assert result.values[0] < 0.75 * math.log(VOCAB)
