"""Real GPU runs as the allocator model's check: every committed snapshot trace replayed.

tests/data/snapshots/ holds numbers derived from public `torch.cuda.memory._dump_snapshot`
pickles by bench/snapshot_replay.py (each file names its repository, path and commit): the
cache the process held when recording began, every request in order, and what the real
allocator did. The model must make the same decisions: the same segments (or, with expandable
segments, the same page maps) in the same order, so the same reserved peak to the byte. That
holds for every committed trace, the default settings' and `expandable_segments:True`'s alike,
so no tolerance is granted; a new trace that misses must be explained, not absorbed. The runs
that freed their cache mid-run did so as the allocator's retry before an OOM: replayed without
those releases at the card's capacity, the model frees its cache at the same allocations.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from bench.snapshot_replay import derive, load_snapshot, releases, replay

DATA = Path(__file__).resolve().parents[1] / "data" / "snapshots"
TRACES = sorted(DATA.glob("*.json"))
# the traces whose cache was freed mid-run (a run of segment frees after the start)
RELEASING = [path for path in TRACES if releases(json.loads(path.read_text()))]


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_the_suite_has_traces_from_several_repositories() -> None:
    traces = [_load(path) for path in TRACES]
    assert len(traces) >= 10
    assert len({trace["source"]["repository"] for trace in traces}) >= 5
    assert all(len(trace["source"]["commit"]) == 40 for trace in traces)
    # the cases: expandable segments, and a run on several streams
    assert any(trace["settings"] and trace["settings"]["expandable_segments"] for trace in traces)
    assert any(len(set(trace.get("streams", [0]))) > 1 for trace in traces)


@pytest.mark.parametrize("path", TRACES, ids=[path.stem for path in TRACES])
def test_a_real_trace_replays_to_its_reserved_peak(path: Path) -> None:
    data = _load(path)
    model = replay(data)
    real = data["real"]
    assert model["segments"] == real["segments"]
    assert model["peak_reserved"] == real["peak_reserved"]
    # the model counts whole blocks, the trace only rounded requests: never fewer bytes
    assert model["peak_allocated"] >= real["peak_allocated_rounded"]


@pytest.mark.parametrize("path", RELEASING, ids=[path.stem for path in RELEASING])
def test_a_release_mid_run_was_the_retry_before_an_oom(path: Path) -> None:
    # Without the recorded releases and given the card's capacity (the real peak reserved:
    # the least the card could have had), the model frees the cache itself where cudaMalloc
    # would fail, and so at the same allocations as the real run: same segments, same peak.
    data = _load(path)
    real = data["real"]
    model = replay(data, capacity=real["peak_reserved"])
    assert model["ooms"] == 0
    assert model["segments"] == real["segments"]
    assert model["peak_reserved"] == real["peak_reserved"]
    unlimited = replay(data, capacity=1 << 62)  # no limit: the releases never happen
    assert unlimited["peak_reserved"] > real["peak_reserved"]


def test_the_suite_has_a_run_that_retried_near_the_card_limit() -> None:
    assert len(RELEASING) >= 2
    assert any((_load(path)["settings"] or {}).get("expandable_segments") for path in RELEASING)


def test_a_snapshot_loads_as_plain_data_and_any_class_is_refused() -> None:
    plain = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 2}]]}
    assert load_snapshot(pickle.dumps(plain)) == plain
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        load_snapshot(pickle.dumps({"segments": [], "device_traces": [], "x": Path("p")}))


def test_a_warm_start_is_rebuilt_from_the_final_state_and_the_trace() -> None:
    base, mib = 1 << 40, 1 << 20
    # At the dump: one 20 MiB segment whose first 4 MiB block was live before recording began;
    # in the trace a 2 MiB block after it is allocated and freed, and a new segment is made.
    snapshot = {
        "segments": [
            {
                "address": base,
                "total_size": 20 * mib,
                "segment_type": "large",
                "stream": 0,
                "blocks": [
                    {"address": base, "size": 4 * mib, "state": "active_allocated"},
                    {"address": base + 4 * mib, "size": 16 * mib, "state": "inactive"},
                ],
            },
            {
                "address": base + 64 * mib,
                "total_size": 40 * mib,
                "segment_type": "large",
                "stream": 0,
                "blocks": [{"address": base + 64 * mib, "size": 40 * mib, "state": "inactive"}],
            },
        ],
        "device_traces": [
            [
                {"action": "alloc", "addr": base + 4 * mib, "size": 2 * mib, "stream": 0},
                {"action": "free_completed", "addr": base + 4 * mib, "size": 2 * mib},
                {"action": "segment_alloc", "addr": base + 64 * mib, "size": 40 * mib},
                {"action": "alloc", "addr": base + 64 * mib, "size": 40 * mib, "stream": 0},
                {"action": "free_completed", "addr": base + 64 * mib, "size": 40 * mib},
            ]
        ],
    }
    data = derive(snapshot)
    assert data["initial"] == [[0, 0, [[4 * mib, 1], [16 * mib, 0]]]]
    assert data["events"] == [2 * mib, -2, 40 * mib, -3]
    assert data["real"]["start_reserved"] == 20 * mib
    assert data["real"]["peak_reserved"] == 60 * mib
    assert replay(data)["segments"] == [40 * mib]
