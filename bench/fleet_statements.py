"""Counting a server's SQL statements per call, for bench/fleet_sim.py.

``python bench/fleet_statements.py COUNTS_FILE serve ...`` runs ``vramtune serve ...`` with a
SQLAlchemy listener on every engine that counts statements and commits under the label of the
HTTP call that ran them (``POST /api/v1/workers/{id}/heartbeat``), or ``background`` (the
reaper, the lifespan's work). A heartbeat batch counts under the heartbeat that started its
writer. Every second the totals, with the requests per label, are written to COUNTS_FILE (JSON,
replaced atomically), so that a benchmark reads them at the start and the end of its window.

A dictionary increment per statement and per request: small beside a statement's own cost.
"""

from __future__ import annotations

import contextvars
import json
import os
import re
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

_LABEL: contextvars.ContextVar[str] = contextvars.ContextVar("fleet_label", default="background")
_IDS = re.compile(r"/\d+(?=/|$)")
_lock = threading.Lock()
statements: Counter[str] = Counter()
commits: Counter[str] = Counter()
requests: Counter[str] = Counter()


def label_of(method: str, path: str) -> str:
    """``POST /api/v1/trials/17/start`` -> ``POST /api/v1/trials/{id}/start``."""
    return f"{method} {_IDS.sub('/{id}', path)}"


def install(counts_file: Path) -> None:
    """Count statements per call from now on; write the counts to `counts_file` every second."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from vramtune.service import metrics

    def on_statement(*_: Any) -> None:
        with _lock:
            statements[_LABEL.get()] += 1

    def on_commit(*_: Any) -> None:
        with _lock:
            commits[_LABEL.get()] += 1

    event.listen(Engine, "before_cursor_execute", on_statement)
    event.listen(Engine, "commit", on_commit)
    timed = metrics.RequestTimer.__call__

    async def labelled(self: Any, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await timed(self, scope, receive, send)
            return
        label = label_of(scope["method"], scope["path"])
        with _lock:
            requests[label] += 1
        token = _LABEL.set(label)
        try:
            await timed(self, scope, receive, send)
        finally:
            _LABEL.reset(token)

    metrics.RequestTimer.__call__ = labelled  # type: ignore[method-assign]

    def dump_forever() -> None:
        while True:
            with _lock:
                snapshot = {
                    "statements": dict(statements),
                    "commits": dict(commits),
                    "requests": dict(requests),
                }
            partial = counts_file.with_suffix(".tmp")
            partial.write_text(json.dumps(snapshot))
            os.replace(partial, counts_file)
            threading.Event().wait(1.0)

    threading.Thread(target=dump_forever, name="fleet-statements", daemon=True).start()


def main() -> None:
    counts_file, *args = sys.argv[1:]
    install(Path(counts_file))
    from vramtune.service.cli.parser import main as vramtune_main

    sys.argv = ["vramtune", *args]
    raise SystemExit(vramtune_main())


if __name__ == "__main__":
    main()
