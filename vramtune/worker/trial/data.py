"""A seeded stream of batches over tensors in memory, keeping the trace exact.

The predictor traces a training step with the task's ``example_batch`` only; any other tensor a
task's ``batches`` keeps alive during the step (an index tensor held in a generator's frame) is
memory the real run has and the trace does not: 512 bytes at least, per tensor.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import torch

from vramtune.worker.trial.task import Batch


def seeded_batches(
    n_examples: int, micro_batch: int, seed: int, make_batch: Callable[[torch.Tensor], Batch]
) -> Iterator[Batch]:
    """Endless `make_batch(indices)` over `n_examples`, epoch by epoch in a seeded order.

    The stream of examples does not depend on `micro_batch`: micro-batches of a resized run
    concatenate to the batches of the run as asked (when the micro-batch divides the batch).
    The order is kept in Python lists and each index tensor dies with its call, so no tensor
    but the batch itself is alive during a step: the trace, which sees only the batch, matches.
    """
    order = random.Random(seed)
    pending: list[int] = []
    while True:
        while len(pending) < micro_batch:
            epoch = list(range(n_examples))
            order.shuffle(epoch)
            pending += epoch
        yield make_batch(torch.tensor(pending[:micro_batch]))
        del pending[:micro_batch]
