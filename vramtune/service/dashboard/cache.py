"""Answers kept while the study they describe is unchanged (its revision token is the same).

A finished study's plots are computed once per server process, however many people open it;
a running study's revision changes with every trial, so its answers are recomputed. Every fact
still lives in the database: a replica with an empty cache answers the same.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar, cast

from sqlalchemy.orm import Session

from vramtune.service.dashboard import schema

Answer = TypeVar("Answer")
MAX_ENTRIES = 128  # a few studies' worth of plots (~100 KB each at 10,000 trials)

_answers: OrderedDict[Hashable, object] = OrderedDict()
_lock = threading.Lock()


def by_revision(
    session: Session,
    study_id: int,
    key: Hashable,
    compute: Callable[[], Answer],
    revision: str | None = None,
) -> Answer:
    """``compute()``, or its earlier answer for the same key if the study has not changed."""
    revision = revision or schema.revision(session, study_id)
    full_key = (str(session.get_bind().engine.url), study_id, key, revision)
    with _lock:
        if full_key in _answers:
            _answers.move_to_end(full_key)
            return cast(Answer, _answers[full_key])  # stored below under this very key
    answer = compute()
    with _lock:
        _answers[full_key] = answer
        while len(_answers) > MAX_ENTRIES:
            _answers.popitem(last=False)
    return answer
