"""Optuna's RDB tables as SQLAlchemy Core tables, from Optuna's own definitions.

Read in bulk by the dashboard (vramtune.service.dashboard.schema) and written by the worker calls
(vramtune.service.optuna.rows); Optuna owns and migrates them.
"""

from __future__ import annotations

from optuna.storages._rdb import models

studies = models.StudyModel.__table__
directions = models.StudyDirectionModel.__table__
study_system_attrs = models.StudySystemAttributeModel.__table__
trials = models.TrialModel.__table__
params = models.TrialParamModel.__table__
values = models.TrialValueModel.__table__
intermediate = models.TrialIntermediateValueModel.__table__
trial_user_attrs = models.TrialUserAttributeModel.__table__
trial_system_attrs = models.TrialSystemAttributeModel.__table__
