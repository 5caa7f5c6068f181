"""The loop on a real card: torch's allocator peaks and a real CUDA out-of-memory (GPU only)."""

from __future__ import annotations

import pytest
import torch
from task_contract import RecordingReporter

from vramtune.service.wire import CardInfo, Plan, TrainBudget
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.charlm import CharTransformerTask
from vramtune.worker.tasks.digits import DigitsCNNTask
from vramtune.worker.trial.runner import CardSpec, OutOfMemory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_card() -> CardSpec:
    """The first GPU as the worker describes it."""
    total = torch.cuda.get_device_properties(0).total_memory
    info = CardInfo(model=torch.cuda.get_device_name(0), total_bytes=total, free_bytes=total)
    return CardSpec(info=info, device="cuda:0")


def test_a_cuda_run_measures_allocated_and_reserved_peaks() -> None:
    config = {"width": 16, "depth": 2, "resolution": 32, "batch_size": 64, "lr": 1e-2}
    budget = TrainBudget(max_steps=20, eval_every=10)
    result = TorchTaskRunner(DigitsCNNTask()).run(
        config, Plan(), budget, cuda_card(), RecordingReporter()
    )
    measured = result.measured
    assert measured.peak_reserved_bytes is not None
    assert 0 < measured.peak_allocated_bytes <= measured.peak_reserved_bytes
    assert result.values[0] > 0.5


def test_a_real_cuda_oom_becomes_out_of_memory_and_frees_the_card() -> None:
    # The token embeddings alone are 64 GiB (4096 x 4096 positions x 1024 floats): no card holds it.
    config = {"n_layers": 8, "d_model": 1024, "n_heads": 16, "seq_len": 4096, "batch_size": 4096}
    before = torch.cuda.memory_allocated(0)
    with pytest.raises(OutOfMemory) as oom:
        TorchTaskRunner(CharTransformerTask()).run(
            config, Plan(), TrainBudget(max_steps=1), cuda_card(), RecordingReporter()
        )
    assert oom.value.measured.peak_allocated_bytes > 0
    assert torch.cuda.memory_allocated(0) <= before + 2**20


def test_a_cuda_run_measures_the_training_steps_and_the_evaluation_apart() -> None:
    """Issue 29: torch's one peak counter is reset around each evaluation; the whole run's
    peak is the larger window's, and each window's is reported."""
    config = {"width": 16, "depth": 2, "resolution": 32, "batch_size": 64, "lr": 1e-2}
    budget = TrainBudget(max_steps=4, eval_every=2)
    result = TorchTaskRunner(DigitsCNNTask()).run(
        config, Plan(), budget, cuda_card(), RecordingReporter()
    )
    measured = result.measured
    assert measured.training_peak_bytes is not None and measured.evaluation_peak_bytes
    assert measured.peak_reserved_bytes is not None
    whole = max(measured.peak_allocated_bytes, measured.peak_reserved_bytes)
    assert max(measured.training_peak_bytes, measured.evaluation_peak_bytes) == whole
