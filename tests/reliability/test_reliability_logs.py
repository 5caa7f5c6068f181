"""vramtune.common.logs and vramtune.worker.loop.spool on their own (no server): what a line and a
kept call hold."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from vramtune.common.logs import configure_logging, log_event
from vramtune.service.wire import FailRequest
from vramtune.worker.loop.spool import Spool


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """The root logger writing to a string; the previous handlers restored after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield io.StringIO()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_the_event_first_and_its_fields(stream: io.StringIO) -> None:
    configure_logging("info", "json", stream)
    log = logging.getLogger("vramtune.test")
    log_event(log, "reoffered", trial_id=7, worker_id=3, when=Path("/x"))
    log_event(log, "hidden", level=logging.DEBUG, trial_id=8)
    log.warning("plain %s", "words")
    first, second = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert next(iter(first)) == "event" and first["event"] == "reoffered"
    assert first["trial_id"] == 7 and first["worker_id"] == 3 and first["when"] == "/x"
    assert first["level"] == "INFO" and first["logger"] == "vramtune.test"
    assert first["time"].endswith("Z")
    assert second["message"] == "plain words" and "event" not in second


def test_fields_named_like_the_line_s_own_keys_keep_their_values(stream: io.StringIO) -> None:
    configure_logging("info", "json", stream)
    log_event(logging.getLogger("t"), "x", message="mine", time=5)
    (line,) = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert line["message_"] == "mine" and line["time_"] == 5 and line["event"] == "x"


def test_text_lines_are_key_value(stream: io.StringIO) -> None:
    configure_logging("info", "text", stream)
    log_event(logging.getLogger("t"), "failed", trial_id=4, kind="oom", message="out of memory")
    log_event(logging.getLogger("t"), "leased", params={"x": 1.5}, note=None)
    first, second = stream.getvalue().splitlines()
    assert first.endswith('failed trial_id=4 kind=oom message_="out of memory"')
    assert second.endswith('leased params={"x": 1.5} note=null')


def test_the_spool_keeps_whole_calls_and_sets_aside_unreadable_files(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    kept = spool.keep("fail", 12, FailRequest(lease="t" * 43, kind="oom", message="m"))
    (tmp_path / "spool" / "0-1-complete.json").write_text('{"call": "comp')  # torn, by hand
    (pending,) = spool.pending()
    assert pending == kept and pending.body["kind"] == "oom"
    assert [p.name for p in (tmp_path / "spool").glob("*.bad")] == ["0-1-complete.bad"]
    spool.answered(kept)
    assert spool.pending() == []
