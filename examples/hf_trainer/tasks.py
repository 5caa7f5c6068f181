"""The few lines that hand stdlib_gpt2.py's Trainer to vramtune:
``vramtune worker --tasks examples/hf_trainer/tasks.py``.

The factory gives what stdlib_gpt2.py gives `Trainer(...)`, with model_init instead of a model;
it is called for each trial, so each gets fresh TrainingArguments.
"""

from __future__ import annotations

import copy
from typing import Any

from vramtune import TrainerTask


def trainer_kwargs() -> dict[str, Any]:
    """The Trainer's keyword arguments, from the user's unchanged module."""
    import stdlib_gpt2  # imported here: a worker without vramtune[hf] is told what it lacks

    return {
        "model_init": stdlib_gpt2.model_init,
        "args": copy.deepcopy(stdlib_gpt2.args),
        "train_dataset": stdlib_gpt2.train_dataset,
        "eval_dataset": stdlib_gpt2.eval_dataset,
        "data_collator": stdlib_gpt2.default_data_collator,
    }


gpt2_trainer = TrainerTask("hf-trainer-gpt2", trainer_kwargs)
