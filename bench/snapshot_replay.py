"""Real CUDA memory snapshots replayed through the allocator model (issue 46).

People commit `torch.cuda.memory._dump_snapshot` pickles to public repositories. Each holds
`device_traces`: every allocation, free and segment event of a real run on a real GPU, in
order, and `segments`: the allocator's state when it was dumped. That is ground truth for
vramtune/worker/predictor/allocator.py without a GPU here.

`derive` reads a snapshot out of a fetched repository (git objects, no work tree), loads it with
an unpickler that refuses every class (a snapshot is plain dicts, lists, strings and numbers;
anything else is refused, never run) and writes only numbers to tests/data/snapshots/:

- `initial`: the segments that existed before recording began (the process was warm), each as
  [small, stream, [[size, live], ...]] in address order. They are the final `segments` with the
  trace undone backwards: a segment allocated in the trace did not exist yet, one freed did;
  a block allocated in the trace was not live yet, one freed was.
- `events`: the requests in order: n > 0 allocates n bytes (the next key, counting from the
  initial live blocks), -k frees key k - 1, 0 is a release of cached segments (a run of
  `segment_free`: `empty_cache()` or the retry before an OOM). `streams` gives each
  allocation's stream index where the run used more than one.
- `real`: what the allocator did: reserved bytes at the start and at the peak, the peak of the
  rounded requested bytes, and the size of every segment it cudaMalloc'ed (or mapped, with
  expandable segments) in order.
- `settings`: the snapshot's `allocator_settings` (PyTorch >= 2.5 records them), or null.
- `source`: repository, path, commit and blob, so anyone can check the numbers.

`report` replays every committed trace and writes bench/results/snapshot_replay.{md,json}.

    python -m bench.snapshot_replay derive /work/.mirror/OWNER+NAME/repo COMMIT PATH [...]
    python -m bench.snapshot_replay report
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from vramtune.worker.device.alloc_conf import (
    ROUNDUP_INTERVALS,
    AllocatorSettings,
    parse,
)
from vramtune.worker.predictor.allocator import (
    SMALL_SEGMENT,
    CachingAllocatorModel,
    round_request,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "snapshots"
RESULTS = ROOT / "bench" / "results"


class _NoClasses(pickle.Unpickler):
    """Loads plain containers only: every class or function reference is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a snapshot holds plain data")


def load_snapshot(raw: bytes) -> dict[str, Any]:
    """The snapshot dict of a pickle's bytes, without running any of its code."""
    data = _NoClasses(io.BytesIO(raw)).load()
    if not isinstance(data, dict) or "device_traces" not in data:
        raise ValueError("not a memory snapshot (no device_traces)")
    return data


def settings_of(snapshot: dict[str, Any]) -> AllocatorSettings | None:
    """The allocator settings a snapshot recorded, or None for older PyTorch."""
    recorded = snapshot.get("allocator_settings")
    if not isinstance(recorded, dict):
        return None
    conf = recorded.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    settings = parse(conf) if conf else AllocatorSettings()
    # The recorded values win over the text: they are what the allocator used.
    split = int(recorded.get("max_split_size", -1))
    table = recorded.get("roundup_power2_divisions") or {}
    divisions = tuple(int(table.get(str(1 << i), 0)) for i in range(ROUNDUP_INTERVALS))
    return AllocatorSettings(
        expandable_segments=bool(recorded.get("expandable_segments", False)),
        max_split_size=None if split < 0 or split >= 1 << 62 else split,
        max_non_split_rounding=settings.max_non_split_rounding,
        roundup_power2_divisions=divisions if table else settings.roundup_power2_divisions,
        garbage_collection_threshold=float(recorded.get("garbage_collection_threshold", 0.0)),
        release_lock_on_cudamalloc=bool(recorded.get("release_lock_on_cudamalloc", False)),
    )


def derive(snapshot: dict[str, Any], device: int = 0) -> dict[str, Any]:
    """The replayable numbers of one device's trace (see the module docstring)."""
    trace = [e for e in snapshot["device_traces"][device] if isinstance(e, dict)]
    segments: dict[int, tuple[int, bool, int]] = {}  # address -> (size, small, stream)
    live: dict[int, int] = {}  # address -> block size
    for segment in snapshot["segments"]:
        if segment.get("device", device) != device:
            continue
        small = segment.get("segment_type") == "small"
        segments[segment["address"]] = (segment["total_size"], small, segment.get("stream", 0))
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live[block["address"]] = block["size"]
    for event in reversed(trace):  # undo the trace: what existed before recording began
        action, address = event["action"], event.get("addr")
        if action == "segment_alloc":
            segments.pop(address, None)
        elif action == "segment_free":
            size = event["size"]
            segments[address] = (size, size == SMALL_SEGMENT, event.get("stream", 0))
        elif action == "segment_map":
            _unmap(segments, address, event["size"])
        elif action == "segment_unmap":
            _map(segments, address, event["size"], event.get("stream", 0))
        elif action == "alloc":
            live.pop(address, None)
        elif action == "free_completed":
            live[address] = round_request(event["size"])

    initial: list[list[Any]] = []
    key_of: dict[int, int] = {}
    for address in sorted(segments):
        size, small, stream = segments[address]
        blocks: list[list[int]] = []
        cursor = address
        for start in sorted(a for a in live if address <= a < address + size):
            if start > cursor:
                blocks.append([start - cursor, 0])
            blocks.append([live[start], 1])
            key_of[start] = len(key_of)
            cursor = start + live[start]
        if cursor < address + size:
            blocks.append([address + size - cursor, 0])
        initial.append([int(small), stream, blocks])

    stream_ids: dict[int, int] = {}
    events: list[int] = []
    streams: list[int] = []
    reserved = sum(size for size, _, _ in segments.values())
    allocated = sum(live[a] for a in key_of)
    real = {"start_reserved": reserved, "peak_reserved": reserved}
    peak_allocated = allocated
    new_segments: list[int] = []
    next_key = len(key_of)
    for event in trace:
        action, address = event["action"], event.get("addr")
        if action == "alloc":
            key_of[address] = next_key
            next_key += 1
            events.append(event["size"])
            streams.append(stream_ids.setdefault(event.get("stream", 0), len(stream_ids)))
            allocated += round_request(event["size"])
            peak_allocated = max(peak_allocated, allocated)
        elif action == "free_completed" and address in key_of:
            events.append(-1 - key_of.pop(address))
            allocated -= round_request(event["size"])
        elif action in ("segment_alloc", "segment_map"):
            reserved += event["size"]
            new_segments.append(event["size"])
            real["peak_reserved"] = max(real["peak_reserved"], reserved)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= event["size"]
            if not events or events[-1] != 0:
                events.append(0)
    real["peak_allocated_rounded"] = peak_allocated
    real["end_reserved"] = reserved
    real["segments"] = new_segments
    settings = settings_of(snapshot)
    out: dict[str, Any] = {
        "settings": None if settings is None else settings.to_dict(),
        "initial": initial,
        "events": events,
        "real": real,
    }
    if len(stream_ids) > 1:
        out["streams"] = streams
    return out


def _unmap(segments: dict[int, tuple[int, bool, int]], address: int, size: int) -> None:
    # An expandable segment's mapped range is reported as one segment however many pages were
    # mapped into it: undoing a map cuts the pages out, leaving the pieces on either side.
    for start, (total, small, stream) in list(segments.items()):
        if start <= address < start + total:
            del segments[start]
            if address > start:
                segments[start] = (address - start, small, stream)
            if address + size < start + total:
                segments[address + size] = (start + total - address - size, small, stream)
            return


def _map(segments: dict[int, tuple[int, bool, int]], address: int, size: int, stream: int) -> None:
    # Undoing an unmap puts the pages back, joined to the mapped ranges they touch.
    small = size == SMALL_SEGMENT
    for start, (total, _, _) in list(segments.items()):
        if start + total == address:
            del segments[start]
            address, size = start, size + total
        elif address + size == start:
            del segments[start]
            size += total
    segments[address] = (size, small, stream)


def replay(data: dict[str, Any], capacity: int | None = None) -> dict[str, Any]:
    """The model's answer for one derived trace: peaks and the segments it would allocate.

    With a `capacity` (what cudaMalloc could give) the releases after the first event are left
    out: the model must make them itself, as the retry before an OOM.
    """
    recorded = data["settings"]
    settings = AllocatorSettings() if recorded is None else AllocatorSettings.from_dict(recorded)
    model = CachingAllocatorModel(settings=settings, capacity=capacity)
    key = 0
    for small, stream, blocks in data["initial"]:
        seeded: list[tuple[int | None, int]] = []
        for size, is_live in blocks:
            seeded.append((key if is_live else None, size))
            key += 1 if is_live else 0
        model.seed_segment(seeded, bool(small), stream)
    streams = data.get("streams")
    allocation = 0
    for index, event in enumerate(data["events"]):
        if event > 0:
            model.malloc(key, event, streams[allocation] if streams else 0)
            key += 1
            allocation += 1
        elif event < 0:
            model.free(-1 - event)
        elif capacity is None or index == 0:
            model.release_cached()
    return {
        "peak_reserved": model.peak_reserved,
        "peak_allocated": model.peak_allocated,
        "segments": model.segment_sizes,
        "ooms": model.ooms,
    }


def releases(data: dict[str, Any]) -> int:
    """The releases of cached segments after the trace's start (empty_cache or OOM retries)."""
    return sum(1 for event in data["events"][1:] if event == 0)


def _slug(repository: str, path: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{repository}__{path}").removesuffix(".pickle")


def _derive_command(args: argparse.Namespace) -> None:
    git = Path(args.repo)
    repository = git.parent.name.replace("+", "/", 1)
    DATA.mkdir(parents=True, exist_ok=True)
    for path in args.paths:
        spec = f"{args.commit}:{path}"
        blob = subprocess.run(
            ["git", "-C", str(git), "rev-parse", spec], capture_output=True, text=True, check=True
        ).stdout.strip()
        raw = subprocess.run(
            ["git", "-C", str(git), "cat-file", "blob", blob], capture_output=True, check=True
        ).stdout
        snapshot = load_snapshot(raw)
        for device, trace in enumerate(snapshot["device_traces"]):
            if not any(event.get("action") == "alloc" for event in trace):
                continue
            data = derive(snapshot, device)
            data["source"] = {
                "repository": repository,
                "path": path,
                "commit": args.commit,
                "blob": blob,
                "device": device,
            }
            name = _slug(repository, path) + f"__{args.commit[:7]}"
            target = DATA / f"{name}{f'__cuda{device}' if device else ''}.json"
            same = _same_trace(data)
            if same is not None:  # a copy committed under another name or commit
                print(path, "is", same.relative_to(ROOT), "again: skipped")
                continue
            target.write_text(json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n")
            print(target.relative_to(ROOT), len(data["events"]), "events")


def _same_trace(data: dict[str, Any]) -> Path | None:
    for file in DATA.glob("*.json"):
        other = json.loads(file.read_text())
        if all(other[key] == data[key] for key in ("initial", "events", "settings")):
            return file
    return None


def _report_command(_: argparse.Namespace) -> None:
    rows = []
    for file in sorted(DATA.glob("*.json")):
        data = json.loads(file.read_text())
        model = replay(data)
        real = data["real"]
        rows.append(
            {
                "trace": file.stem,
                "source": data["source"],
                "settings": "default"
                if data["settings"] is None
                or AllocatorSettings.from_dict(data["settings"]).is_default
                else data["settings"],
                "allocations": sum(1 for e in data["events"] if e > 0),
                "real_peak_reserved": real["peak_reserved"],
                "model_peak_reserved": model["peak_reserved"],
                "real_segments": len(real["segments"]),
                "segments_match": model["segments"] == real["segments"],
                "real_peak_allocated_rounded": real["peak_allocated_rounded"],
                "model_peak_allocated": model["peak_allocated"],
                "releases": releases(data),
                "releases_as_retries": _as_retries(data),
            }
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "snapshot_replay.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "# Real CUDA memory snapshots replayed through the allocator model",
        "",
        "`python -m bench.snapshot_replay report`; the traces are tests/data/snapshots/ "
        "(derived numbers only, see bench/snapshot_replay.py). Reserved is the allocator's "
        "segments; allocated is the rounded requested bytes (real) against the model's "
        "block bytes, which also count a block's unsplit rest.",
        "",
        "Releases: the runs of segment frees after the start; 'retries' where the model, "
        "given the card's capacity (the real peak reserved, the least the card could have "
        "had) and not the releases, frees the cache itself before a cudaMalloc that would "
        "fail and reaches the same segments and peak.",
        "",
        "| trace | allocations | real peak reserved | model | error | segments | "
        "real peak allocated | model | releases |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for row in rows:
        real, model = row["real_peak_reserved"], row["model_peak_reserved"]
        error = (model - real) / real * 100 if real else 0.0
        retries = row["releases_as_retries"]
        released = f"{row['releases']}" + (
            "" if retries is None else " (retries)" if retries else " (not retries)"
        )
        lines.append(
            f"| {row['trace']} | {row['allocations']} | {real:,} | {model:,} | {error:+.2f} % | "
            f"{'same' if row['segments_match'] else 'differ'} ({row['real_segments']}) | "
            f"{row['real_peak_allocated_rounded']:,} | {row['model_peak_allocated']:,} | "
            f"{released} |"
        )
    (RESULTS / "snapshot_replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _as_retries(data: dict[str, Any]) -> bool | None:
    # None without releases; else whether the model at the card's capacity makes them itself.
    if not releases(data):
        return None
    real = data["real"]
    model = replay(data, capacity=real["peak_reserved"])
    return (model["segments"], model["peak_reserved"], model["ooms"]) == (
        real["segments"],
        real["peak_reserved"],
        0,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    derive_parser = commands.add_parser("derive")
    derive_parser.add_argument("repo")
    derive_parser.add_argument("commit")
    derive_parser.add_argument("paths", nargs="+")
    derive_parser.set_defaults(run=_derive_command)
    commands.add_parser("report").set_defaults(run=_report_command)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
