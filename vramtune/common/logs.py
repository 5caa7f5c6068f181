"""Structured logs: one event with its fields (trial and worker ids, ...) a line.

Call ``log_event(log, "reoffered", trial_id=7, worker_id=3, attempt=1)`` wherever something
happens to a trial or a worker. ``configure_logging(level, "json")`` (``--log-format json``)
writes every record as one JSON object a line, the event's name first::

    {"event": "reoffered", "time": "2026-12-02T12:00:00.123Z", "level": "INFO",
     "logger": "vramtune.reaper", "trial_id": 7, "worker_id": 3, "attempt": 1}

and records that are not events as ``{"time": ..., "level": ..., "logger": ..., "message": ...}``.
With the text format an event reads ``reoffered trial_id=7 worker_id=3 attempt=1`` (logfmt:
values that are not plain words are JSON-quoted). Nothing but the standard library is imported,
so a worker-only install has it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from datetime import UTC, datetime
from typing import IO, Any, Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")

# Keys of every JSON line; a field of the same name is written with a trailing underscore.
_RESERVED = frozenset({"event", "time", "level", "logger", "message", "exception"})
_EVENT = "vramtune_event"
_FIELDS = "vramtune_fields"
_PLAIN = re.compile(r"[\w.:/@+-]+")


def log_event(
    logger: logging.Logger, event: str, *, level: int = logging.INFO, **fields: Any
) -> None:
    """Log one event and its fields (JSON-serializable, else written with ``str``).

    Args:
        logger: where it goes, e.g. ``logging.getLogger("vramtune.reaper")``.
        event: what happened, one snake_case word: ``leased``, ``completed``, ``reoffered``.
        level: the logging level (INFO unless given).
        **fields: ids and facts, by name: ``trial_id=7, worker_id=3``. ``None`` values are kept.
    """
    if not logger.isEnabledFor(level):
        return
    named = {f"{k}_" if k in _RESERVED else k: v for k, v in fields.items()}
    logger.log(level, "%s", _logfmt(event, named), extra={_EVENT: event, _FIELDS: named})


def one_line(error: BaseException) -> str:
    """The error's type and the first line of its message, for a warning that must stay one
    line: a database driver's message runs to many (the SQL, its parameters, a link)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def log_outage(logger: logging.Logger, where: str, error: BaseException, **fields: Any) -> None:
    """One WARNING line for a call the database failed: ``database_unavailable where=... error=
    "OperationalError: ..."``. During an outage every request logs one, so it must stay one
    line: the driver's message (the SQL, its parameters, a link) is cut to its first."""
    facts = {"where": where, **fields, "error": one_line(error)}
    log_event(logger, "database_unavailable", level=logging.WARNING, **facts)


def event_fields(record: logging.LogRecord) -> tuple[str, dict[str, Any]] | None:
    """The event name and fields of a record ``log_event`` made; None for other records."""
    event = getattr(record, _EVENT, None)
    return None if event is None else (str(event), dict(getattr(record, _FIELDS, {})))


def _logfmt(event: str, fields: dict[str, Any]) -> str:
    return " ".join([event, *(f"{key}={_value(value)}" for key, value in fields.items())])


def _value(value: Any) -> str:
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return value
    if isinstance(value, bool | int | float | str | list | dict | None):
        return json.dumps(value, default=str)
    return json.dumps(str(value))


class JsonFormatter(logging.Formatter):
    """Every record as one JSON object: events with their fields, others with their message."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON (a traceback goes in ``exception``)."""
        stamp = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        base = {"time": stamp.replace("+00:00", "Z"), "level": record.levelname}
        base["logger"] = record.name
        found = event_fields(record)
        if found is None:
            line: dict[str, Any] = {**base, "message": record.getMessage()}
        else:
            line = {"event": found[0], **base, **found[1]}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(level: str, log_format: LogFormat, stream: IO[str] | None = None) -> None:
    """The root logger at ``level`` writing ``log_format`` lines to ``stream`` (stderr)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def json_logging_config(level: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` writing JSON lines from every logger (uvicorn's too)."""
    uvicorn = {"handlers": [], "propagate": True}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {
            "json": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["json"], "level": level.upper()},
        "loggers": {name: uvicorn for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }


def add_log_format_option(parser: argparse.ArgumentParser, default: LogFormat) -> None:
    """``--log-format text|json``; env ``VRAMTUNE_LOG_FORMAT`` overrides ``default``."""
    chosen = os.environ.get("VRAMTUNE_LOG_FORMAT", default)
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=chosen if chosen in LOG_FORMATS else default,
        help="json: one JSON object per line (for log shippers); text: events as "
        "'name key=value ...' (env VRAMTUNE_LOG_FORMAT, default %(default)s)",
    )
