"""Will it fit? The predictor on its own: a training step's peak memory, card by card.

- `api`: ``fit(model_or_task, batch=..., optimizer="adamw", step=None, cards=[...])`` and its
  ``FitResult`` / ``CardFit`` (re-exported from `vramtune`); imports torch.
- `cards`: the card table (``Card``, ``CARDS``, ``register_card``) and the CUDA context
  counted against each card; torch-free.
- `adapter`: ``ModuleTask``, a plain model, batch and optimizer as a task.
- `hf_config`: ``hf:PATH``, a local Hugging Face config.json, as a `ModuleTask` (LoRA too).
- `cli`: ``vramtune fit TASK_FILE`` (or ``hf:PATH``; ``--world-size``, ``--lora``,
  ``--progress``); torch-free until the command runs.

Nothing is imported here: `vramtune --help` loads `cli` without torch.
"""
