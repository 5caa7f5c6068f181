"""The HTTP edge: REST routers (routes/), their dependencies (deps.py) and errors (errors.py)."""
