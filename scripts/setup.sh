#!/usr/bin/env bash
# Sets up everything vramtune's demo and tests need on a fresh Debian machine; idempotent.
# Creates .venv, installs the CPU build of torch first (a plain `torch` requirement would pull a
# multi-GB CUDA build), then the project with its dev extras; installs Chromium for the browser
# tests and Debian's Slurm (slurm-wlm, munge) for the Slurm launcher's test, and makes sure the
# local PostgreSQL is up when one is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "torch==${VRAMTUNE_TORCH_VERSION:-2.13.0}"
.venv/bin/pip install -q -e ".[dev]"

if [ "${VRAMTUNE_SKIP_SYSTEM:-0}" != 1 ]; then
  if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null
  fi
  # tests/deploy/test_slurm.py submits deploy/slurm's script to a one-node Slurm of its own.
  if ! command -v slurmctld >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq slurm-wlm munge >/dev/null
  fi
  if command -v pg_ctlcluster >/dev/null 2>&1; then
    cluster="$(ls /etc/postgresql)"
    if ! pg_isready -q -h 127.0.0.1 -p 5432; then
      pg_ctlcluster --skip-systemctl-redirect "$cluster" main start
    fi
    # The suite runs several servers at once (two replicas, a pool each for vramtune and
    # Optuna): PostgreSQL's default of 100 connections leaves too little headroom.
    if [ "$(psql -h 127.0.0.1 -U postgres -Atc 'show max_connections' 2>/dev/null || echo 0)" -lt 300 ]; then
      psql -h 127.0.0.1 -U postgres -qc "ALTER SYSTEM SET max_connections = 300" &&
        pg_ctlcluster --skip-systemctl-redirect "$cluster" main restart
    fi
  fi
fi
