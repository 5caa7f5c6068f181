#!/usr/bin/env bash
# The test command: set up, lint, type-check and run the whole suite (SQLite and PostgreSQL,
# real servers, real workers, headless Chromium). Extra arguments go to pytest.
#   --quick: no setup; lint, types and the fast tier only (unit tests: no browser, no e2e fleet,
#   no reliability or deploy runs), for the edit-test loop.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = "--quick" ]; then
  quick=1
  shift
fi
[ "$quick" = 1 ] || bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check vramtune tests bench scripts
.venv/bin/mypy vramtune
# pytest exits 5 when it collects no tests; set -e turns that into a failure.
if [ "$quick" = 1 ]; then
  exec .venv/bin/python -m pytest tests/test_boundary.py tests/service tests/worker tests/docs \
    -m "not slow and not browser and not reliability and not gpu" "$@"
fi
.venv/bin/python -m pytest "$@"
