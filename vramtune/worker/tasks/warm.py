"""What a worker traces as it starts (vramtune.worker.predictor.warmup): tiny built-in
configurations.

Attention, layer norm, embeddings, convolutions, group norm, pooling, cross-entropy and foreach
AdamW are the ops most models start with.
"""

from __future__ import annotations

from vramtune.worker.predictor.warmup import Workload
from vramtune.worker.tasks.charlm import CharTransformerTask
from vramtune.worker.tasks.digits import DigitsCNNTask


def warm_up_workloads() -> list[Workload]:
    """A one-layer GPT and a two-layer CNN, each at batch 2."""
    return [
        (
            CharTransformerTask(),
            {"n_layers": 1, "d_model": 16, "n_heads": 2, "seq_len": 8, "batch_size": 2},
        ),
        (DigitsCNNTask(), {"width": 4, "depth": 2, "resolution": 8, "batch_size": 2}),
    ]
