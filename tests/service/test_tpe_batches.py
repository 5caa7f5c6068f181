"""TPE asked in batches: one Parzen fit per batch, on the history as the batch began.

The rule (service.optuna.tpe): a batch reads the study once; trials asked before it (RUNNING
in Optuna) are lied about, the batch's own drafts are not lied about to each other; nothing is
kept across batches but Optuna's cache of finished trials, so a trial another process (or
replica) tells is seen by the next batch, never a stale RUNNING or COMPLETE state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import FrozenTrial, TrialState

from vramtune.service.db.engine import make_engine, make_sessions
from vramtune.service.optuna import rows as optuna_rows
from vramtune.service.optuna.drafts import DraftStorage, draft_trials
from vramtune.service.optuna.glue import dispose_storage, make_storage
from vramtune.service.optuna.tpe import SharedFitTPESampler
from vramtune.service.state import utcnow

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPACE = {"x": FloatDistribution(-10.0, 10.0), "y": FloatDistribution(-10.0, 10.0)}
NAME = "tpe-batches"


@pytest.fixture
def study(migrated_url: str) -> Iterator[optuna.Study]:
    """A study with 30 told trials and one RUNNING (asked, not told), on vramtune's storage."""
    storage = make_storage(migrated_url)
    study = optuna.create_study(study_name=NAME, storage=storage)
    study.sampler = optuna.samplers.RandomSampler(seed=0)
    for _ in range(30):
        trial = study.ask(SPACE)
        study.tell(trial, (trial.params["x"] - 2) ** 2 + (trial.params["y"] + 1) ** 2)
    study.ask(SPACE)  # RUNNING: a trial a worker runs now
    yield study
    dispose_storage(storage)


def _fits(sampler: SharedFitTPESampler, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record each Parzen estimator the sampler builds: (below?, the trials it is built on)."""
    built: list[tuple[bool, list[FrozenTrial]]] = []
    build = sampler._build_parzen_estimator

    def spy(study: Any, space: Any, trials: list[FrozenTrial], handle_below: bool) -> Any:
        built.append((handle_below, list(trials)))
        return build(study, space, trials, handle_below)

    monkeypatch.setattr(sampler, "_build_parzen_estimator", spy)
    return built


def _draft(study: optuna.Study, sampler: optuna.samplers.BaseSampler, count: int) -> list[Any]:
    number = len(study.get_trials(deepcopy=False))
    return draft_trials(study._storage, study._study_id, NAME, sampler, SPACE, number, count)


@pytest.mark.parametrize(
    "args", [{}, {"constant_liar": False}, {"multivariate": False}, {"n_ei_candidates": 5}]
)
def test_a_batch_of_one_is_what_optunas_tpe_proposes(
    study: optuna.Study, args: dict[str, Any]
) -> None:
    """The batch path (Optuna's _sample split in two) draws as Optuna's own TPESampler."""
    for seed in (1, 2, 3):
        ours = _draft(study, SharedFitTPESampler(seed=seed, **args), 1)[0].params
        optunas = _draft(study, optuna.samplers.TPESampler(seed=seed, **args), 1)[0].params
        assert ours == optunas


def test_a_batch_fits_once_on_the_history_and_lies_about_trials_asked_before(
    study: optuna.Study, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampler = SharedFitTPESampler(seed=4)
    built = _fits(sampler, monkeypatch)
    drafts = _draft(study, sampler, 6)
    assert [d.number for d in drafts] == list(range(31, 37))
    assert len({(d.params["x"], d.params["y"]) for d in drafts}) == 6
    assert all(SPACE[k]._contains(v) for d in drafts for k, v in d.params.items())
    assert [below for below, _ in built] == [True, False], "one fit for the six drafts"
    above = built[1][1]
    running = [t.number for t in above if t.state == TrialState.RUNNING]
    assert running == [30], "the trial asked before the batch is lied about, not the drafts"
    assert len(built[0][1]) + len(above) == 31

    built.clear()
    for _ in range(2):  # outside a batch of several: Optuna's TPE, one fit per ask
        _draft(study, sampler, 1)
    assert [below for below, _ in built] == [True, False, True, False]


def test_a_trial_told_by_another_process_is_seen_by_the_next_batch(
    study: optuna.Study, migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica A drafts, replica B (its own storage and cache) tells the RUNNING trial the
    best value, A's next batch fits on it as COMPLETE: no stale RUNNING is served."""
    sampler = SharedFitTPESampler(seed=5)
    built = _fits(sampler, monkeypatch)
    _draft(study, sampler, 2)  # A's cache now holds trial 30 as RUNNING
    [running] = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))

    other = make_storage(migrated_url)  # replica B
    engine = make_engine(migrated_url)
    try:
        with make_sessions(engine).begin() as session:
            optuna_rows.finish(session, running._trial_id, TrialState.COMPLETE, utcnow(), [-1.0])
    finally:
        dispose_storage(other)
        engine.dispose()

    built.clear()
    _draft(study, sampler, 2)
    below = {t.number: t for t in built[0][1]}
    assert below[30].state == TrialState.COMPLETE and below[30].value == -1.0
    assert all(t.state != TrialState.RUNNING for _, trials in built for t in trials)


def test_a_batch_reads_the_study_once(study: optuna.Study) -> None:
    reads: list[Any] = []
    storage = study._storage
    original = storage.get_all_trials

    def counted(*args: Any, **kwargs: Any) -> list[FrozenTrial]:
        reads.append(kwargs.get("states"))
        return original(*args, **kwargs)

    storage.get_all_trials = counted  # type: ignore[method-assign]
    try:
        drafts = DraftStorage(storage, study._study_id, NAME, 31)
        batch = optuna.Study(study_name=NAME, storage=drafts, sampler=SharedFitTPESampler())
        for _ in range(3):
            batch.ask(SPACE)
    finally:
        del storage.get_all_trials
    assert reads == [None]
    assert [d.number for d in drafts.drafts] == [31, 32, 33]
    history = drafts.get_all_trials(study._study_id, states=(TrialState.RUNNING,))
    assert [t.number for t in history] == [30, 31, 32, 33], "the batch's drafts see each other"
