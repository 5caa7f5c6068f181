"""vramtune on Optuna's storage: the glue (glue.py), rows written in vramtune's transactions
(rows.py), trials asked without writing (drafts.py) and Optuna's tables (tables.py).

Modules here import the ``optuna`` library by its absolute name; this package is
``vramtune.service.optuna`` and never shadows it.
"""
