#!/usr/bin/env bash
# The test command: set up, lint, type-check and run the whole suite (SQLite and PostgreSQL,
# real servers, real workers, headless Chromium). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check common service worker tests bench migrations scripts
.venv/bin/mypy common service worker
# pytest exits 5 when it collects no tests; set -e turns that into a failure.
.venv/bin/python -m pytest "$@"
