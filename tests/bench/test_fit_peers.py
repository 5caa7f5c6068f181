"""bench/fit_peers.py's quick mode on the zoo's MLP: vramtune's side always (exact against the real
CPU peak), each peer's figure where the peer is installed (they are bench-only: the [bench-peers]
extra, never in [dev]) and a "not installed" row where it is not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from bench import fit_peers

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def mlp_rows() -> list[fit_peers.Row]:
    rows, failed = fit_peers.run(fit_peers.fit_cases(quick=True, only="mlp"))
    assert not failed
    return rows


def test_vramtune_predicts_the_real_cpu_peak_to_the_byte(mlp_rows: list[fit_peers.Row]) -> None:
    (row,) = mlp_rows
    estimate = row.estimates["vramtune"]
    assert row.measured_bytes > 0
    assert estimate.predicted_bytes == row.measured_bytes and estimate.error == 0
    assert estimate.seconds is not None and estimate.seconds > 0


def test_each_peer_has_a_figure_or_says_why_not(mlp_rows: list[fit_peers.Row]) -> None:
    (row,) = mlp_rows
    installed = fit_peers.versions()
    for name in fit_peers.PEERS:
        estimate = row.estimates[name]
        if installed[name] is None:
            assert estimate.predicted_bytes is None and estimate.note == "not installed"
        else:
            assert estimate.predicted_bytes is not None and estimate.error is not None, estimate


def test_the_report_has_every_tool_and_the_case(
    mlp_rows: list[fit_peers.Row], tmp_path: Path
) -> None:
    stats = fit_peers.summary(mlp_rows, fit_peers.versions())
    env = {k: "x" for k in ("date", "torch", "python", "cpus", "load_start", "load_end")}
    report = fit_peers.markdown({**env, "arguments": ""}, stats, mlp_rows, {})
    assert stats["vramtune"]["exact"] == 1 and stats["vramtune"]["within"] == 1
    for tool in fit_peers.TOOLS:
        assert f"| {tool} |" in report
    assert "| mlp B32 as asked |" in report


@pytest.mark.skipif(
    importlib.util.find_spec("kitsune") is None, reason="torch-kitsune not installed"
)
def test_kitsune_is_compared_on_its_tensor_part(mlp_rows: list[fit_peers.Row]) -> None:
    parts = mlp_rows[0].estimates["torch-kitsune"].parts
    tensor_part = sum(v for k, v in parts.items() if k != "overhead_not_compared")
    assert mlp_rows[0].estimates["torch-kitsune"].predicted_bytes == tensor_part
