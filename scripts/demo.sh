#!/usr/bin/env bash
# The demo: set up, then run `vramtune demo` on the embedded SQLite default (auth off, loopback):
# a service, two CPU workers with simulated cards of different sizes and the character
# Transformer example study. It exits once the study's trials are done (`--keep-serving`
# keeps the dashboard up until Ctrl-C); the study stays in ./vramtune-demo.db.
set -euo pipefail
cd "$(dirname "$0")/.."
VRAMTUNE_SKIP_SYSTEM=1 bash scripts/setup.sh
exec .venv/bin/vramtune demo "$@"
