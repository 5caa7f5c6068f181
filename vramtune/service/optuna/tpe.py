"""Optuna's TPESampler, with one Parzen fit shared by the drafts of one batch.

Profile of one TPE ask on a 10,000-trial PostgreSQL study (Optuna 5.1, warm, ~60 ms): reading
the history is incremental already (``_CachedStorage`` keeps finished trials and re-reads only
new and unfinished ones, ~3 ms) and nothing deep-copies it (TPE reads with ``deepcopy=False``).
The ask is Optuna's own per-trial Python over the whole history: splitting it into below/above
(~18 ms), building the two Parzen estimators (~11 ms), and the acquisition function of 24
candidates against the ~10,000 kernels above (~18 ms, numpy). The first two depend only on the
history, so trials asked together share them: a batch fits once and draws each trial's
candidates and argmax from that one fit, the third cost staying per trial.

The rule a batch follows (``shared_fits``): every draft of a batch is Optuna's TPE proposal
for the history as read when the batch began, as if its k workers had asked at the same
instant. Trials asked before the batch (pending or leased, RUNNING in Optuna) are in that
history, and with ``constant_liar`` (Optuna's default since 4.x, and the service's) they are
lied about as Optuna does; the drafts of one batch are not lied about to each other. Outside a
batch the sampler is Optuna's TPESampler unchanged. No fit outlives its batch: nothing is
cached across asks beyond what Optuna's ``_CachedStorage`` caches (finished trials, which never
change), so a trial told by another process or replica is seen by the next batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.samplers import TPESampler
from optuna.samplers._tpe.parzen_estimator import _ParzenEstimator
from optuna.samplers._tpe.sampler import _split_trials, default_gamma, default_gamma_multiobjective
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState


@dataclass(frozen=True)
class _Fit:
    """The two Parzen estimators TPE fits on a history, for one search space."""

    below: _ParzenEstimator
    above: _ParzenEstimator


_FitKey = tuple[tuple[str, BaseDistribution], ...]
# The fits of the batch the current thread drafts; None outside a batch.
_batch_fits: ContextVar[dict[_FitKey, _Fit] | None] = ContextVar("vramtune_tpe_fits", default=None)


@contextmanager
def shared_fits() -> Iterator[None]:
    """Within this block, TPE asks share one fit per search space (see the module doc)."""
    token = _batch_fits.set({})
    try:
        yield
    finally:
        _batch_fits.reset(token)


class SharedFitTPESampler(TPESampler):
    """Optuna's TPESampler (same arguments); inside ``shared_fits`` one fit serves a batch.

    ``_fit`` and ``_draw`` are the two halves of Optuna 5.1's ``TPESampler._sample`` calling
    Optuna's own split, estimators, acquisition and argmax; tests/service/test_tpe_batches.py
    checks that a batch's first draft is what Optuna's TPESampler proposes with the same seed.
    """

    def _sample(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        fits = _batch_fits.get()
        if fits is None:
            return super()._sample(study, trial, search_space)
        key = tuple(search_space.items())
        fit = fits.get(key)
        if fit is None:
            fit = fits[key] = self._fit(study, trial, search_space)
        return self._draw(fit, search_space)

    def _fit(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> _Fit:
        """The first half of ``TPESampler._sample``: split the history, fit below and above."""
        if self._constant_liar:
            states = [TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING]
        else:
            states = [TrialState.COMPLETE, TrialState.PRUNED]
        trials = study._get_trials(deepcopy=False, states=states, use_cache=not self._constant_liar)
        if self._constant_liar:  # the trial being asked is not its own lie
            trials = [t for t in trials if trial.number != t.number]
        if self._gamma is None:
            single = len(study.directions) <= 1
            self._gamma = default_gamma if single else default_gamma_multiobjective
        # Running trials do not count towards gamma (https://github.com/optuna/optuna/pull/4073).
        n = sum(t.state != TrialState.RUNNING for t in trials)
        below, above = _split_trials(study, trials, self._gamma(n))
        return _Fit(
            below=self._build_parzen_estimator(study, search_space, below, handle_below=True),
            above=self._build_parzen_estimator(study, search_space, above, handle_below=False),
        )

    def _draw(self, fit: _Fit, search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        """The second half: candidates from below, the one that maximizes below/above."""
        samples = fit.below.sample(self._rng.rng, self._n_ei_candidates)
        acquisition = self._compute_acquisition_func(samples, fit.below, fit.above)
        chosen = TPESampler._compare(samples, acquisition)
        return {name: d.to_external_repr(chosen[name]) for name, d in search_space.items()}
