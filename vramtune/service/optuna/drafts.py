"""Asking a study's sampler for a trial without writing it: the trial is drafted in memory.

``Study.ask`` on RDBStorage commits the new trial, then each parameter and attribute the
sampler sets, one by one, before vramtune has leased anything. Here the ask runs on a
``DraftStorage``: every read goes to the study's real storage (so samplers see the study's
history as usual), the one new trial and the writes made to it stay in memory, and
``service.optuna.rows.insert_trial`` writes the finished draft with vramtune's own rows in one
transaction. Samplers and ``Study.ask`` are Optuna's, unchanged.

Several trials are drafted in one go (``draft_trials``, the ask-ahead of service.fleet.dispatch)
on one ``DraftStorage``: the study's history is read once, when the first ask reads it, and
every later ask of the batch sees that history and the batch's earlier drafts (RUNNING, as
Optuna's concurrent asks see each other). TPE shares one Parzen fit across the batch
(vramtune.service.optuna.tpe).

Trials enqueued into WAITING through Optuna directly are not popped by a draft: vramtune asks
every trial of its studies itself.
"""

from __future__ import annotations

import copy
from collections.abc import Container, Sequence
from datetime import datetime
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.study._frozen import FrozenStudy
from optuna.trial import FrozenTrial, TrialState

from vramtune.service.optuna.tpe import shared_fits

DRAFT_ID = -1  # the first draft's trial id until it is inserted (the next: -2, -3, ...)


class DraftStorage(BaseStorage):
    """A study's storage, its trials read once, holding new trials' writes in memory."""

    def __init__(self, storage: BaseStorage, study_id: int, study_name: str, number: int) -> None:
        self._storage = storage
        self._study_id = study_id
        self._study_name = study_name
        self._number = number
        self.drafts: list[FrozenTrial] = []
        self._history: list[FrozenTrial] | None = None

    # ---- the draft trials: created, parameterized and read in memory

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        if template_trial is not None:
            raise RuntimeError("a DraftStorage drafts new trials, not copies")
        draft = FrozenTrial(
            number=self._number + len(self.drafts),
            state=TrialState.RUNNING,
            value=None,
            values=None,
            datetime_start=datetime.now(),
            datetime_complete=None,
            params={},
            distributions={},
            user_attrs={},
            system_attrs={},
            intermediate_values={},
            trial_id=DRAFT_ID - len(self.drafts),
        )
        self.drafts.append(draft)
        return draft._trial_id

    def _own(self, trial_id: int) -> FrozenTrial:
        index = DRAFT_ID - trial_id
        if not 0 <= index < len(self.drafts):
            raise RuntimeError(f"a draft ask may write its own trials only, not {trial_id}")
        return self.drafts[index]

    def set_trial_param(
        self,
        trial_id: int,
        param_name: str,
        param_value_internal: float,
        distribution: BaseDistribution,
    ) -> None:
        draft = self._own(trial_id)
        draft.params[param_name] = distribution.to_external_repr(param_value_internal)
        draft.distributions[param_name] = distribution

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._own(trial_id).user_attrs[key] = value

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._own(trial_id).system_attrs[key] = value

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        raise RuntimeError("a draft trial is told through vramtune, not during its ask")

    def set_trial_intermediate_value(self, trial_id: int, step: int, value: float) -> None:
        raise RuntimeError("a draft trial has no intermediate values")

    def get_trial(self, trial_id: int) -> FrozenTrial:
        if trial_id < 0:
            return copy.deepcopy(self._own(trial_id))
        return self._storage.get_trial(trial_id)

    def get_all_trials(
        self,
        study_id: int,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
    ) -> list[FrozenTrial]:
        if states == (TrialState.WAITING,):
            return []  # Study.ask looking for an enqueued trial: see the module doc
        if study_id != self._study_id:
            return self._storage.get_all_trials(study_id, deepcopy=deepcopy, states=states)
        if self._history is None:  # once per batch: what its asks see (module doc)
            self._history = self._storage.get_all_trials(study_id, deepcopy=False)
        trials = [*self._history, *self.drafts]
        if states is not None:
            trials = [t for t in trials if t.state in states]
        return copy.deepcopy(trials) if deepcopy else trials

    # ---- the study: read through (study attributes a sampler sets are written through)

    def get_study_id_from_name(self, study_name: str) -> int:
        if study_name == self._study_name:
            return self._study_id
        return self._storage.get_study_id_from_name(study_name)

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._storage.get_study_name_from_id(study_id)

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self._storage.get_study_directions(study_id)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._storage.get_study_user_attrs(study_id)

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._storage.get_study_system_attrs(study_id)

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._storage.set_study_user_attr(study_id, key, value)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._storage.set_study_system_attr(study_id, key, value)

    def get_all_studies(self) -> list[FrozenStudy]:
        return self._storage.get_all_studies()

    def create_new_study(
        self, directions: Sequence[StudyDirection], study_name: str | None = None
    ) -> int:
        raise RuntimeError("a DraftStorage asks; it does not create studies")

    def delete_study(self, study_id: int) -> None:
        raise RuntimeError("a DraftStorage asks; it does not delete studies")


def draft_trials(
    storage: BaseStorage,
    study_id: int,
    study_name: str,
    sampler: optuna.samplers.BaseSampler,
    space: dict[str, BaseDistribution],
    number: int,
    count: int = 1,
) -> list[FrozenTrial]:
    """Ask the sampler for ``count`` new trials of the study over ``space``, written nowhere yet.

    ``number``: the number the first trial is expected to get (the study's count of trials);
    the grid sampler picks its point by it. Two concurrent drafts may expect the same number,
    as two processes asking one RDBStorage may: the inserted trials are numbered exactly.
    """
    drafts = DraftStorage(storage, study_id, study_name, number)
    study = optuna.Study(study_name=study_name, storage=drafts, sampler=sampler)
    with shared_fits():
        for _ in range(count):
            study.ask(fixed_distributions=space)
    return drafts.drafts
