"""What the service and the worker both use beyond the wire contract (service/wire.py).

Standard library only, like the contract, so that a worker-only install and the server import
it without each other's dependencies. Today: structured logs (logs.py).
"""
