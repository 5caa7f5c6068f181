"""Summarize a py-spy raw (collapsed-stack) profile: where a server's samples go.

``bench/service_throughput.py`` records one with ``BENCH_PYSPY=/tmp/prefix_`` (and
``BENCH_PYSPY_ARGS="--gil -r 200"``: only threads holding the GIL, i.e. Python CPU time).
This prints, in Markdown, the share of samples per entry point (route), per layer (the
innermost library frame of each sample) and per function (inclusive and self), and with
``--rate`` and ``--requests`` the ms of CPU per request those shares are.

Usage: ``python bench/profile_summary.py PROFILE.txt --rate 200 --requests 652 [--top 40]``.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]*)(?::\d+)?\)$")

# Layers by file path, first match wins, checked from the innermost frame outwards: a sample
# is charged to the first frame that belongs to one of these.
LAYERS: list[tuple[str, str]] = [
    ("psycopg (driver: adapt, send, parse)", "psycopg/"),
    ("SQLAlchemy compile / cache key", "sqlalchemy/sql/"),
    ("SQLAlchemy ORM (session, flush, loading)", "sqlalchemy/orm/"),
    ("SQLAlchemy engine / pool", "sqlalchemy/"),
    ("pydantic", "pydantic"),
    ("Optuna", "optuna/"),
    ("prometheus_client", "prometheus_client/"),
    ("logging", "logging/"),
    ("json", "json/"),
    ("FastAPI", "fastapi/"),
    ("Starlette", "starlette/"),
    ("uvicorn / h11 / httptools", "uvicorn/"),
    ("h11", "h11/"),
    ("anyio", "anyio/"),
    ("asyncio", "asyncio/"),
    ("vramtune service/", "service/"),
]


def parse(path: Path) -> Counter[tuple[str, ...]]:
    """Stacks (outermost first, frames as ``func (file)``) and their sample counts."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = []
        for frame in stack.split(";"):
            match = FRAME.match(frame)
            frames.append(f"{match['func']} ({match['file']})" if match else frame)
        stacks[tuple(frames)] += int(count)
    return stacks


def entry(frames: tuple[str, ...]) -> str:
    """The request a sample serves: the outermost service/ frame, else the outermost frame."""
    for frame in frames:
        if "(service/" in frame:
            return frame
    return frames[0] if frames else "?"


def layer(frames: tuple[str, ...]) -> str:
    """The innermost frame's layer (LAYERS)."""
    for frame in reversed(frames):
        for name, marker in LAYERS:
            if f"({marker}" in frame or f"/{marker}" in frame:
                return name
    return "other (stdlib, threading)"


def inclusive(stacks: Counter[tuple[str, ...]]) -> Counter[str]:
    """Samples with the function anywhere on the stack (counted once per stack)."""
    found: Counter[str] = Counter()
    for frames, count in stacks.items():
        for frame in set(frames):
            found[frame] += count
    return found


def table(
    title: str, counts: Iterable[tuple[str, int]], total: int, ms_per_sample: float | None
) -> list[str]:
    """A Markdown table: name, samples, share, and ms of CPU per request when known."""
    head = "| " + title + " | samples | share |" + (" ms / request |" if ms_per_sample else "")
    lines = [head, "|---|---|---|" + ("---|" if ms_per_sample else "")]
    for name, count in counts:
        row = f"| `{name}` | {count} | {100 * count / total:.1f} % |"
        if ms_per_sample:
            row += f" {count * ms_per_sample:.2f} |"
        lines.append(row)
    return [*lines, ""]


def main() -> None:
    """Print the summary of one profile."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--rate", type=float, help="py-spy's samples per second")
    parser.add_argument("--requests", type=int, help="requests the server answered meanwhile")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    stacks = parse(args.profile)
    total = sum(stacks.values())
    per_sample = None
    if args.rate and args.requests:
        per_sample = 1000.0 / args.rate / args.requests
    print(f"{total} samples" + (f" = {total / args.rate:.2f} s" if args.rate else ""))
    print()
    entries: Counter[str] = Counter()
    layers: Counter[str] = Counter()
    selfs: Counter[str] = Counter()
    for frames, count in stacks.items():
        entries[entry(frames)] += count
        layers[layer(frames)] += count
        selfs[frames[-1]] += count
    for title, counts in (
        ("entry point", entries.most_common(args.top)),
        ("layer (innermost frame)", layers.most_common()),
        ("function, inclusive", inclusive(stacks).most_common(args.top)),
        ("function, self", selfs.most_common(args.top)),
    ):
        print("\n".join(table(title, counts, total, per_sample)))


if __name__ == "__main__":
    main()
