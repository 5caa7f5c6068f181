"""Will it fit? The predictor on its own: a training step's peak memory, card by card.

- `api`: ``fit(model_or_task, batch=..., optimizer="adamw", step=None, cards=[...])`` and its
  ``FitResult`` / ``CardFit`` (re-exported from `vramtune`); imports torch.
- `cards`: the card table (``Card``, ``CARDS``, ``register_card``); torch-free.
- `adapter`: ``ModuleTask``, a plain model, batch and optimizer as a task.
- `cli`: ``vramtune fit TASK_FILE``; torch-free until the command runs.

Nothing is imported here: `vramtune --help` loads `cli` without torch.
"""
