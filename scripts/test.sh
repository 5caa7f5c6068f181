#!/usr/bin/env bash
# The test command: set up, lint, type-check and run the whole suite (SQLite and PostgreSQL,
# real servers, real workers, headless Chromium). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check vramtune tests bench scripts
.venv/bin/mypy vramtune
# pytest exits 5 when it collects no tests; set -e turns that into a failure.
.venv/bin/python -m pytest "$@"
