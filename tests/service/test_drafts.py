"""Drafted asks and Optuna's rows written in vramtune's session, read back by plain Optuna."""

from __future__ import annotations

import math
from collections.abc import Iterator

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState
from sqlalchemy.orm import Session

from vramtune.service.db.engine import make_engine, make_sessions
from vramtune.service.errors import Conflict
from vramtune.service.optuna import rows as optuna_rows
from vramtune.service.optuna.drafts import DRAFT_ID, draft_trials
from vramtune.service.optuna.glue import dispose_storage, make_storage
from vramtune.service.state import utcnow

optuna.logging.set_verbosity(optuna.logging.WARNING)
pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

SPACE = {
    "x": FloatDistribution(-1.0, 1.0),
    "n": IntDistribution(1, 64, log=True),
    "act": CategoricalDistribution(["relu", "gelu"]),
}
SAMPLERS = {
    "random": lambda: optuna.samplers.RandomSampler(seed=1),
    "tpe": lambda: optuna.samplers.TPESampler(seed=1, n_startup_trials=2),
    "qmc": lambda: optuna.samplers.QMCSampler(seed=1),
    "nsga2": lambda: optuna.samplers.NSGAIISampler(seed=1, population_size=2),
    "grid": lambda: optuna.samplers.GridSampler(
        {"x": [-1.0, 0.0, 1.0], "n": [1, 8], "act": ["relu", "gelu"]}, seed=1
    ),
}


@pytest.fixture
def study(migrated_url: str) -> Iterator[tuple[optuna.Study, Session]]:
    """An Optuna study with three told trials, and a vramtune session on the same database."""
    storage = make_storage(migrated_url)
    engine = make_engine(migrated_url)
    study = optuna.create_study(study_name="drafts", storage=storage)
    for value in (0.5, 0.2, 0.9):
        trial = study.ask(SPACE)
        study.tell(trial, value)
    with make_sessions(engine)() as session:
        yield study, session
    dispose_storage(storage)
    engine.dispose()


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_a_draft_writes_nothing_until_inserted_then_optuna_reads_it_whole(
    study: tuple[optuna.Study, Session], name: str
) -> None:
    optuna_study, session = study
    storage = optuna_study._storage
    sid = optuna_study._study_id
    [draft] = draft_trials(storage, sid, "drafts", SAMPLERS[name](), SPACE, number=3)
    assert draft._trial_id == DRAFT_ID and draft.state == TrialState.RUNNING
    assert set(draft.params) == set(SPACE)
    assert all(SPACE[k]._contains(SPACE[k].to_internal_repr(v)) for k, v in draft.params.items())
    assert len(optuna_study.trials) == 3, "a draft is not in the storage"

    with session.begin():
        assert optuna_rows.lock_study(session, sid)
        [inserted] = optuna_rows.insert_trials(session, sid, [draft], utcnow())
    reread = optuna.load_study(study_name="drafts", storage=storage).trials[-1]
    assert (reread.number, reread._trial_id) == (3, inserted._trial_id)
    assert reread.state == TrialState.RUNNING
    assert reread.params == draft.params
    assert reread.distributions == draft.distributions
    assert reread.system_attrs == draft.system_attrs  # grid_id, NSGA-II's generation, ...


def test_insert_numbers_after_the_study_and_finish_reads_back_as_optuna_tells(
    study: tuple[optuna.Study, Session],
) -> None:
    optuna_study, session = study
    storage, sid = optuna_study._storage, optuna_study._study_id
    sampler = optuna.samplers.RandomSampler(seed=2)
    drafts = [
        draft_trials(storage, sid, "drafts", sampler, SPACE, number=3 + i)[0] for i in range(3)
    ]
    now = utcnow()
    with session.begin():
        optuna_rows.lock_study(session, sid)
        first, second, third = optuna_rows.insert_trials(session, sid, drafts, now)
        optuna_rows.set_attrs(session, first._trial_id, {"a": 1, "b": [2]}, system=False)
        optuna_rows.set_attrs(session, first._trial_id, {"a": 3}, system=False)  # replaced
        optuna_rows.set_intermediate(session, first._trial_id, 0, 0.7)
        optuna_rows.finish(session, first._trial_id, TrialState.COMPLETE, now, [0.1])
        optuna_rows.finish(session, second._trial_id, TrialState.COMPLETE, now, [math.inf])
        optuna_rows.finish(session, third._trial_id, TrialState.FAIL, now)
    trials = optuna.load_study(study_name="drafts", storage=storage).trials
    assert [t.number for t in trials] == [0, 1, 2, 3, 4, 5]
    done, infinite, failed = trials[3:]
    assert (done.state, done.values, done.user_attrs) == (
        TrialState.COMPLETE,
        [0.1],
        {"a": 3, "b": [2]},
    )
    assert done.intermediate_values == {0: 0.7}
    assert done.datetime_complete is not None
    assert infinite.values == [math.inf]
    assert (failed.state, failed.values) == (TrialState.FAIL, None)
    assert optuna.load_study(study_name="drafts", storage=storage).best_value == 0.1


def test_finishing_a_trial_optuna_has_finished_is_a_conflict_and_changes_nothing(
    study: tuple[optuna.Study, Session],
) -> None:
    optuna_study, session = study
    told = optuna_study.trials[0]
    with pytest.raises(Conflict, match="already finished in Optuna"), session.begin():
        optuna_rows.finish(session, told._trial_id, TrialState.COMPLETE, utcnow(), [7.0])
    assert optuna_study.trials[0].values == told.values
    with pytest.raises(Conflict, match="not in the Optuna storage"), session.begin():
        optuna_rows.finish(session, 10**9, TrialState.COMPLETE, utcnow(), [7.0])
