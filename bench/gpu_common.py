"""What the GPU checks (bench/gpu_ranks.py, bench/gpu_offload.py) share: the decoder they run,
a reporter that lets every step run, and the relative error they report."""

from __future__ import annotations

from vramtune.worker.trial.task import Config

HF_CONFIG: Config = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "seq_len": 256,
    "batch_size": 16,
    "lr": 1e-3,
}
"""A 2-layer transformers Llama: small enough for any card, large enough to measure."""


class Quiet:
    """A reporter that never prunes and never stops (the benchmark's stand-in for the agent)."""

    def report(self, step: int, value: float) -> bool:
        return False

    def stop_reason(self) -> str | None:
        return None


def relative_error(predicted: int, measured: int | None) -> float | None:
    """(predicted - measured) / measured; None without a measurement."""
    return None if not measured else (predicted - measured) / measured


def percent(error: float | None) -> str:
    """A relative error as a signed percentage."""
    return "-" if error is None else f"{error * 100:+.2f} %"
