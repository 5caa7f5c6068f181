"""vramtune's service: the FastAPI server, its database and the CLI.

Importing this package imports nothing: `vramtune.service.wire` (the contract) must stay usable from
a worker-only install that has no server dependencies.
"""
