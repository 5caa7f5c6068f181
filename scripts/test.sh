#!/usr/bin/env bash
# The test command: set up, lint, type-check and run the whole suite (SQLite and PostgreSQL,
# real servers, real workers, headless Chromium). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy service worker
# The fault/load suite (tests/reliability) is opt-in: `bash scripts/test.sh -m reliability`.
# It failed in this version's last full run (see README, Tests); it is not counted as passing.
if [ $# -eq 0 ]; then set -- -m "not reliability"; fi
# pytest exits 5 when it collects no tests; set -e turns that into a failure.
.venv/bin/python -m pytest "$@"
