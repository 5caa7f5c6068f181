"""Optuna glue: storage, search space, sampler and pruner from a study's spec.

Workers' asks go through ``load_optuna_study`` so that they use the study's own sampler and
pruner; samplers are kept per process so that a seeded sampler keeps its random state.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import threading
import typing
import warnings
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from weakref import WeakKeyDictionary

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.pruners import BasePruner
from optuna.samplers import BaseSampler
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages._cached_storage import _CachedStorage
from optuna.trial import FrozenTrial, TrialState
from pydantic import TypeAdapter, ValidationError
from sqlalchemy.orm import Session

from vramtune.service.db.engine import engine_kwargs, read_one_snapshot
from vramtune.service.db.tables import StudyRow, TrialRow
from vramtune.service.errors import Invalid, NotFound
from vramtune.service.optuna import rows as optuna_rows
from vramtune.service.optuna.arguments import PRUNER_BOUNDS, SAMPLER_BOUNDS, Bound
from vramtune.service.optuna.tpe import SharedFitTPESampler
from vramtune.service.wire import (
    STORED_SPEC,
    CategoricalParam,
    FloatParam,
    IntParam,
    PrunerSpec,
    SamplerSpec,
    StudyCreate,
)

SEARCH_SPACE_ATTR = "vramtune.search_space"
TASK_ATTR = "vramtune.task"

Param = FloatParam | IntParam | CategoricalParam


class SnapshotRDBStorage(RDBStorage):
    """Optuna's RDBStorage whose trial reads each see one snapshot of the database (issue 49).

    RDBStorage builds trials from several SELECTs in one session: the trial rows (their state),
    then the user attributes, the values, the intermediate values, the parameters and the system
    attributes (``get_trial`` loads them lazily, one by one). Each SELECT saw its own snapshot
    (PostgreSQL's READ COMMITTED; pysqlite's reads without a transaction), so a read straddling
    the commit of a tell built a RUNNING trial with the values told, but without the attributes
    read before the commit: an infeasible trial's placeholder values without their
    ``vramtune.placeholder_values`` mark, then served as JSON null. Every tell commits Optuna's
    rows and vramtune's together (service.optuna.rows); read in one snapshot, a trial is as it
    was before a tell or after it, never between. The snapshot, rather than marking placeholders
    some other way, because it holds for every row of a trial (an outcome, a plan, a constraint)
    and for Optuna's own readers of the trial in this process (samplers, pruners, the cache).

    ``_CachedStorage`` keeps a trial once it is read finished and never reads it again: it is
    read after its tell committed, so whole. Only what is written to a finished trial later
    stays out of a copy cached before: a run pruned at its report gets its measured peak with
    the worker's next call (service.fleet.trials._keep_measured), which vramtune's row keeps.
    """

    def _get_trials(
        self,
        study_id: int,
        states: Container[TrialState] | None,
        included_trial_ids: set[int],
        trial_id_greater_than: int,
    ) -> list[FrozenTrial]:
        self._begin_snapshot()
        return super()._get_trials(study_id, states, included_trial_ids, trial_id_greater_than)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        self._begin_snapshot()
        return super().get_trial(trial_id)

    def _begin_snapshot(self) -> None:
        """Begin the session the read then uses (this thread's) as one snapshot."""
        session = self.scoped_session()
        try:
            read_one_snapshot(session)
        except BaseException:
            session.close()
            raise


def make_storage(url: str) -> BaseStorage:
    """Optuna storage on an upgraded database, cached as ``optuna.load_study(storage=url)`` is;
    its trials read in one snapshot each (SnapshotRDBStorage)."""
    rdb = SnapshotRDBStorage(url, engine_kwargs=engine_kwargs(url), skip_table_creation=True)
    return _CachedStorage(rdb)


def dispose_storage(storage: BaseStorage) -> None:
    """Close the storage's connection pool."""
    backend = storage._backend if isinstance(storage, _CachedStorage) else storage
    if isinstance(backend, RDBStorage):
        backend.engine.dispose()


# ---------------------------------------------------------------- search space


def to_distribution(name: str, param: Param) -> BaseDistribution:
    """The Optuna distribution of one wire parameter; Invalid names the field on error."""
    field = f"search_space.{name}"
    if not isinstance(param, CategoricalParam) and param.low >= param.high:
        raise Invalid(f"{field}.high", f"high ({param.high}) must exceed low ({param.low})")
    try:
        if isinstance(param, FloatParam):
            return FloatDistribution(param.low, param.high, log=param.log, step=param.step)
        if isinstance(param, IntParam):
            return IntDistribution(param.low, param.high, log=param.log, step=param.step)
        return CategoricalDistribution(param.choices)
    except ValueError as exc:
        raise Invalid(field, str(exc)) from exc


def search_space(spec: StudyCreate) -> dict[str, BaseDistribution]:
    """The study's space as Optuna distributions (``fixed_distributions`` of an ask)."""
    return {name: to_distribution(name, param) for name, param in spec.search_space.items()}


def search_space_json(space: Mapping[str, BaseDistribution]) -> dict[str, str]:
    """The space in Optuna's own JSON (``optuna.distributions.json_to_distribution``)."""
    return {name: optuna.distributions.distribution_to_json(d) for name, d in space.items()}


# ---------------------------------------------------------------- sampler and pruner

_SIMPLE_TYPES: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": str}


def _json_arg_type(annotation: Any) -> Any | None:
    """A type a JSON argument can be checked against, None when it takes a Python object."""
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    parts = [part.strip() for part in text.split("|")]
    if any(part not in _SIMPLE_TYPES and part != "None" for part in parts):
        return None
    types = [type(None) if part == "None" else _SIMPLE_TYPES[part] for part in parts]
    union = types[0]
    for extra in types[1:]:
        union = union | extra
    return union


def _check_args(
    factory: Callable[..., Any],
    args: Mapping[str, Any],
    field: str,
    bounds: Mapping[str, Bound],
    special: set[str],
    stored: bool = False,
) -> dict[str, Any]:
    """Check JSON arguments against the factory's signature and their bounds, naming the bad one.

    ``stored``: the spec of a study accepted before a bound existed; its numbers are clamped
    into bounds (a study keeps running, at a bounded cost) instead of refused.
    """
    settable = _settable(factory, bounds)
    checked: dict[str, Any] = {}
    for key, value in args.items():
        if key in special:
            continue
        if key not in settable:
            raise Invalid(
                f"{field}.{key}", f"not an argument settable over REST; known: {sorted(settable)}"
            )
        try:
            checked[key] = TypeAdapter(settable[key]).validate_python(value, strict=True)
        except ValidationError as exc:
            raise Invalid(f"{field}.{key}", exc.errors()[0]["msg"]) from exc
        if key not in bounds:
            continue
        if stored:
            checked[key] = bounds[key].clamp(checked[key])
        elif (problem := bounds[key].problem(value)) is not None:
            raise Invalid(f"{field}.{key}", problem)
    return checked


def _settable(factory: Callable[..., Any], bounds: Mapping[str, Bound]) -> dict[str, Any]:
    """Arguments a JSON value may set, with their types: booleans, and bounded numbers or
    strings (vramtune.service.optuna.arguments); an unbounded one would let a client set any
    cost."""
    settable = {}
    for key, parameter in inspect.signature(factory).parameters.items():
        arg_type = _json_arg_type(parameter.annotation)
        if arg_type is not None and (key in bounds or _only_bool(arg_type)):
            settable[key] = arg_type
    return settable


def _only_bool(arg_type: Any) -> bool:
    return set(typing.get_args(arg_type) or (arg_type,)) <= {bool, type(None)}


def _construct(factory: Callable[..., Any], field: str, **kwargs: Any) -> Any:
    """Call a sampler or pruner class; its TypeError/ValueError becomes a 422 on ``field``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental-feature warnings are not errors here
            return factory(**kwargs)
    except (TypeError, ValueError) as exc:
        raise Invalid(field, str(exc)) from exc


# "tpe" is Optuna's TPESampler with the same arguments and defaults (constant_liar=True since
# Optuna 4.x: trials asked and not told yet are lied about); trials asked together share one
# Parzen fit (vramtune.service.optuna.tpe).
_SAMPLERS: dict[str, Callable[..., BaseSampler]] = {
    "tpe": SharedFitTPESampler,
    "random": optuna.samplers.RandomSampler,
    "nsga2": optuna.samplers.NSGAIISampler,
    "cmaes": optuna.samplers.CmaEsSampler,
    "gp": optuna.samplers.GPSampler,
    "qmc": optuna.samplers.QMCSampler,
    "grid": optuna.samplers.GridSampler,
}
# Samplers whose sampling needs a package the server may lack.
_SAMPLER_NEEDS = {"cmaes": "cmaes", "gp": "torch"}
_SINGLE_OBJECTIVE_SAMPLERS = {"cmaes"}


def _point_count(name: str, param: Param) -> int:
    """How many values one parameter takes; Invalid for a continuous one (a grid needs none)."""
    if isinstance(param, CategoricalParam):
        return len(param.choices)
    if isinstance(param, FloatParam) and param.step is None:
        raise Invalid("sampler.name", f"grid needs discrete parameters; {name} is continuous")
    return int((param.high - param.low) // (param.step or 1)) + 1


def _grid_values(name: str, param: Param) -> list[Any]:
    """All points of one parameter, for the grid sampler."""
    if isinstance(param, CategoricalParam):
        return list(param.choices)
    step = param.step or 1
    return [param.low + i * step for i in range(_point_count(name, param))]


def check_space_size(spec: StudyCreate, limit: int) -> None:
    """Invalid when the points a study enumerates are over ``limit`` (max_search_space_points).

    The grid sampler holds its whole grid (every parameter's values multiplied) in memory,
    and samplers keep per-choice state for the combinations of categorical parameters; both
    are counted without building them.
    """
    grid = spec.sampler.name == "grid"
    counted = {
        name: _point_count(name, param)
        for name, param in spec.search_space.items()
        if grid or isinstance(param, CategoricalParam)
    }
    points = math.prod(counted.values())
    if points > limit:
        what = "the grid" if grid else "the categorical parameters' combinations"
        raise Invalid(
            "search_space",
            f"{what} ({' x '.join(map(str, counted.values()))}) make {points} points, over the "
            f"limit of {limit} (setting VRAMTUNE_MAX_SEARCH_SPACE_POINTS)",
        )


def make_sampler(spec: StudyCreate, stored: bool = False) -> BaseSampler:
    """The study's sampler; Invalid names ``sampler.name`` or ``sampler.args`` on error.

    ``stored``: built for a study already accepted (see ``_check_args``)."""
    sampler: SamplerSpec = spec.sampler
    needed = _SAMPLER_NEEDS.get(sampler.name)
    if needed and importlib.util.find_spec(needed) is None:
        raise Invalid("sampler.name", f"{sampler.name} needs {needed!r} installed on the server")
    if sampler.name in _SINGLE_OBJECTIVE_SAMPLERS and len(spec.objective_directions) > 1:
        raise Invalid("sampler.name", f"{sampler.name} supports a single objective only")
    factory = _SAMPLERS[sampler.name]
    bounds = SAMPLER_BOUNDS[sampler.name]
    special = {"search_space"}
    kwargs = _check_args(factory, sampler.args, "sampler.args", bounds, special, stored)
    if sampler.name == "grid":
        kwargs["search_space"] = {n: _grid_values(n, p) for n, p in spec.search_space.items()}
    return _construct(factory, "sampler.args", **kwargs)  # type: ignore[no-any-return]


_PRUNERS: dict[str, Callable[..., BasePruner]] = {
    "none": optuna.pruners.NopPruner,
    "median": optuna.pruners.MedianPruner,
    "percentile": optuna.pruners.PercentilePruner,
    "hyperband": optuna.pruners.HyperbandPruner,
    "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
    "threshold": optuna.pruners.ThresholdPruner,
    "patient": optuna.pruners.PatientPruner,
}


def make_pruner(spec: PrunerSpec, field: str = "pruner", stored: bool = False) -> BasePruner:
    """The study's pruner; ``patient`` takes ``wrapped_pruner`` as a nested {name, args}.

    ``stored``: built for a study already accepted (see ``_check_args``)."""
    factory = _PRUNERS[spec.name]
    bounds = PRUNER_BOUNDS[spec.name]
    special = {"wrapped_pruner"}
    kwargs = _check_args(factory, spec.args, f"{field}.args", bounds, special, stored)
    if spec.name == "patient":
        wrapped = spec.args.get("wrapped_pruner")
        try:
            context = STORED_SPEC if stored else None
            inner = None if wrapped is None else PrunerSpec.model_validate(wrapped, context=context)
        except ValidationError as exc:
            raise Invalid(f"{field}.args.wrapped_pruner", str(exc)) from exc
        nested = f"{field}.args.wrapped_pruner"
        kwargs["wrapped_pruner"] = None if inner is None else make_pruner(inner, nested, stored)
    return _construct(factory, f"{field}.args", **kwargs)  # type: ignore[no-any-return]


# ---------------------------------------------------------------- loading a study

# created_at is part of a study's key: SQLite may reuse the id of a deleted study.
_StudyKey = tuple[int, str, str]


@dataclass
class Strategy:
    """How a study asks and prunes: built once per process and storage, as its spec is fixed.

    Kept so that a seeded sampler keeps its random state, and so that a worker call neither
    re-validates the spec nor looks the Optuna study up by name.
    """

    space: dict[str, BaseDistribution]
    sampler: BaseSampler
    pruner: BasePruner
    study: optuna.Study | None = None


_strategies: WeakKeyDictionary[BaseStorage, dict[_StudyKey, Strategy]] = WeakKeyDictionary()
_specs: dict[_StudyKey, StudyCreate] = {}
_cache_lock = threading.Lock()


def _key(row: StudyRow) -> _StudyKey:
    return (row.study_id, row.name, row.created_at.isoformat())


def spec_of(row: StudyRow) -> StudyCreate:
    """The spec a study was created with (validated once per process)."""
    key = _key(row)
    spec = _specs.get(key)
    if spec is None:
        spec = StudyCreate.model_validate(row.spec, context=STORED_SPEC)
        with _cache_lock:
            _specs[key] = spec
    return spec


def strategy(storage: BaseStorage, row: StudyRow) -> Strategy:
    """The sampler and pruner of a study, built once per process and storage."""
    key = _key(row)
    with _cache_lock:
        per_storage = _strategies.setdefault(storage, {})
        found = per_storage.get(key)
    if found is None:
        spec = spec_of(row)
        sampler = make_sampler(spec, stored=True)
        found = Strategy(search_space(spec), sampler, make_pruner(spec.pruner, stored=True))
        with _cache_lock:
            found = per_storage.setdefault(key, found)
    return found


def forget_study(storage: BaseStorage, study_id: int) -> None:
    """Drop what is cached of a deleted study."""
    with _cache_lock:
        per_storage = _strategies.get(storage, {})
        for key in [k for k in per_storage if k[0] == study_id]:
            del per_storage[key]
        for key in [k for k in _specs if k[0] == study_id]:
            del _specs[key]


def load_optuna_study(storage: BaseStorage, row: StudyRow) -> optuna.Study:
    """The Optuna study of a vramtune study, with its sampler and pruner; NotFound if gone."""
    found = strategy(storage, row)
    if found.study is None:
        try:
            found.study = optuna.Study(
                study_name=row.name, storage=storage, sampler=found.sampler, pruner=found.pruner
            )
        except KeyError as exc:
            raise NotFound(f"study {row.name!r} is not in the Optuna storage") from exc
    return found.study


def asked_trial(storage: BaseStorage, row: StudyRow, trial: TrialRow) -> FrozenTrial:
    """The trial as it was asked (number, params, distributions), from vramtune's row.

    Rows from before migration 0002 carry no params: those are read from Optuna.
    """
    if trial.params is None:
        return storage.get_trial(trial.trial_id)
    space = strategy(storage, row).space
    return FrozenTrial(
        number=trial.number,
        state=TrialState.RUNNING,
        value=None,
        values=None,
        datetime_start=None,
        datetime_complete=None,
        params=trial.params,
        distributions={name: space[name] for name in trial.params},
        user_attrs={},
        system_attrs={},
        intermediate_values={},
        trial_id=trial.trial_id,
    )


def tell(
    session: Session,
    storage: BaseStorage,
    row: StudyRow,
    trial: TrialRow,
    state: TrialState,
    now: datetime,
    values: Sequence[float] | None = None,
) -> None:
    """Finish a trial in Optuna within the caller's transaction, as ``Study.tell`` would.

    ``Study.tell`` calls the sampler's ``after_trial`` and then stores the state; so does this,
    handing ``after_trial`` the trial as asked (vramtune.service.optuna.glue.asked_trial). Optuna's
    built-in samplers read its state, values and id there, and nothing else unless they were
    given a ``constraints_func``, which cannot be set over REST.
    """
    study = load_optuna_study(storage, row)
    # GridSampler calls study.stop() once its grid is told, which raises outside an optimize
    # loop; the service has no loop to stop (its budget is n_trials), so stopping is a no-op.
    study.stop = _no_loop_to_stop  # type: ignore[method-assign]
    study.sampler.after_trial(study, asked_trial(storage, row, trial), state, values)
    optuna_rows.finish(session, trial.trial_id, state, now, values)


def _no_loop_to_stop() -> None:
    """What ``Study.stop`` does in the service: nothing (see ``tell``)."""
