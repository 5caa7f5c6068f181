"""API tokens and scopes (tokens.py), the guard on every request (guard.py), ``vramtune token``
(cli.py)."""
