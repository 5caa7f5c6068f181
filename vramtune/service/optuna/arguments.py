"""Bounds on every sampler and pruner argument a study may set over REST.

A study's sampler runs inside the server on every ask, so an argument is a cost any submit
token can set: TPE's ``n_ei_candidates: 4000000`` made one ask take a minute and slowed every
other client's reads. Each number, and each string, that a sampler or pruner takes has a bound
here; one without a bound is not settable over REST (vramtune.service.optuna.glue), so an argument a
new Optuna adds stays closed until it is given one. Booleans need none. The study-file
reference (scripts/docs_reference.py) prints this table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SEED_MAX = 2**32 - 1  # NumPy's RandomState takes seeds in [0, 2**32)
RESOURCE_MAX = 10**9  # steps: the largest step a report may carry
TRIALS_MAX = 10**6  # the largest trial budget of a study


@dataclass(frozen=True)
class Bound:
    """The values one argument may take: numbers in [low, high], or one of ``choices``.

    ``low`` / ``high`` of None leave that side open (any finite number), for arguments that
    only compare against a metric and so cost nothing whatever they are.
    """

    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()

    def problem(self, value: object) -> str | None:
        """Why ``value`` is out of bounds, or None when it is within them (None always is)."""
        if value is None or isinstance(value, bool):
            return None
        if isinstance(value, str):
            if value in self.choices:
                return None
            return f"must be one of {list(self.choices)}" if self.choices else "must be a number"
        if not isinstance(value, int | float) or not math.isfinite(value):
            return "must be a finite number"
        if (self.low is not None and value < self.low) or (
            self.high is not None and value > self.high
        ):
            return f"must be {self.describe()}"
        return None

    def clamp(self, value: object) -> object:
        """The nearest value within bounds: how a study stored before a bound existed runs."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return value
        if self.low is not None and value < self.low:
            return type(value)(self.low)
        if self.high is not None and value > self.high:
            return type(value)(self.high)
        return value

    def describe(self) -> str:
        """The bound in words, as the reference and the 422 say it."""
        words = []
        if self.low is not None and self.high is not None:
            words.append(f"between {_number(self.low)} and {_number(self.high)}")
        elif self.low is not None:
            words.append(f"at least {_number(self.low)}")
        elif self.high is not None:
            words.append(f"at most {_number(self.high)}")
        if self.choices:
            words.append("one of " + ", ".join(repr(choice) for choice in self.choices))
        return " or ".join(words) or "any finite number"


def _number(value: float) -> str:
    if isinstance(value, int) and abs(value) >= 10**6 and value == 10 ** round(math.log10(value)):
        return f"10**{round(math.log10(value))}"
    return str(value)


SEED = Bound(0, SEED_MAX)
STARTUP_TRIALS = Bound(0, TRIALS_MAX)
PROBABILITY = Bound(0.0, 1.0)
WARMUP_STEPS = Bound(0, RESOURCE_MAX)
INTERVAL_STEPS = Bound(1, RESOURCE_MAX)
MIN_TRIALS = Bound(1, TRIALS_MAX)
REDUCTION_FACTOR = Bound(2, 100)
BOOTSTRAP_COUNT = Bound(0, 1000)
ANY_FINITE = Bound()

# name (as SamplerSpec.name / PrunerSpec.name) -> argument -> bound. Sampler costs grow with
# n_ei_candidates (TPE scores that many candidates per parameter per ask) and population sizes.
SAMPLER_BOUNDS: dict[str, dict[str, Bound]] = {
    "tpe": {
        "prior_weight": Bound(0.0, 1e6),
        "n_startup_trials": STARTUP_TRIALS,
        "n_ei_candidates": Bound(1, 1024),
        "seed": SEED,
    },
    "random": {"seed": SEED},
    "nsga2": {
        "population_size": Bound(2, 1000),
        "mutation_prob": PROBABILITY,
        "crossover_prob": PROBABILITY,
        "swapping_prob": PROBABILITY,
        "seed": SEED,
    },
    "cmaes": {
        "sigma0": Bound(1e-12, 1e6),
        "n_startup_trials": STARTUP_TRIALS,
        "seed": SEED,
        "restart_strategy": Bound(choices=("ipop", "bipop")),
        "popsize": Bound(1, 1000),
        "inc_popsize": Bound(-1, 10),
    },
    "gp": {"seed": SEED, "n_startup_trials": STARTUP_TRIALS},
    "qmc": {"qmc_type": Bound(choices=("sobol", "halton")), "seed": SEED},
    "grid": {"seed": SEED},
}

_MEDIAN = {
    "n_startup_trials": STARTUP_TRIALS,
    "n_warmup_steps": WARMUP_STEPS,
    "interval_steps": INTERVAL_STEPS,
    "n_min_trials": MIN_TRIALS,
}
# Pruner costs grow with the brackets and rungs their resources make, and with bootstraps.
PRUNER_BOUNDS: dict[str, dict[str, Bound]] = {
    "none": {},
    "median": _MEDIAN,
    "percentile": {"percentile": Bound(0.0, 100.0), **_MEDIAN},
    "hyperband": {
        "min_resource": Bound(1, RESOURCE_MAX),
        "max_resource": Bound(1, RESOURCE_MAX, choices=("auto",)),
        "reduction_factor": REDUCTION_FACTOR,
        "bootstrap_count": BOOTSTRAP_COUNT,
    },
    "successive_halving": {
        "min_resource": Bound(1, RESOURCE_MAX, choices=("auto",)),
        "reduction_factor": REDUCTION_FACTOR,
        "min_early_stopping_rate": Bound(0, 100),
        "bootstrap_count": BOOTSTRAP_COUNT,
    },
    "threshold": {
        "lower": ANY_FINITE,
        "upper": ANY_FINITE,
        "n_warmup_steps": WARMUP_STEPS,
        "interval_steps": INTERVAL_STEPS,
    },
    "patient": {"patience": Bound(0, RESOURCE_MAX), "min_delta": Bound(0.0, None)},
}
