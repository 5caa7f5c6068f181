"""Writing a benchmark's results: ``NAME.md`` (what a person reads) and ``NAME.json`` (the
figures) under one folder, the report echoed to stdout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(out: Path, name: str, result: dict[str, Any], report: str) -> None:
    """``out/NAME.md`` with `report`, ``out/NAME.json`` with `result`, and the report printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(report)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    print(report)
