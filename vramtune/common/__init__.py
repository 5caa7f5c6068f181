"""What the service and the worker both use beyond the wire contract (vramtune/service/wire.py).

It imports only the contract (and the standard library), so that a worker-only install and the
server import it without each other's dependencies: structured logs (`logs`), the model-family
rules a study is checked against (`task_rules`), the peak rule and the calibration arithmetic
(`memory`), what identifies a run and keys a shared prediction (`plans`), the step-time model
(`step_time`) and token lifetimes (`durations`).
"""
