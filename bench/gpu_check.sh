#!/usr/bin/env bash
# One command for a person with one CUDA GPU: checks the predictor against the card in < 10 min.
#
#   bash scripts/setup.sh            # once, with a CUDA build of torch (VRAMTUNE_TORCH_VERSION)
#   bash bench/gpu_check.sh
#
# It installs nothing. It runs the `gpu`-marked tests (the fake-cuda prediction against the
# card's measured peak, LoRA and QLoRA's int8/nf4 bases included when peft and torchao are
# installed, the CUDA training loop) and the GPU predictor benchmark on the zoo
# (predicted allocated/reserved against torch.cuda.max_memory_allocated/reserved and NVML's
# per-process peak, bench/predictor_accuracy.py --gpu), and writes
#   bench/results/gpu_tests.md
#   bench/results/gpu_predictor_accuracy.{md,json}
#   bench/results/gpu_offload.{md,json} (the offload rungs: predicted vs measured, step time)
#   bench/results/gpu_ranks.{md,json}   (with 2+ GPUs: per-rank prediction vs NCCL ranks)
# Without a CUDA device it says so and exits with status 2, writing nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
RESULTS=bench/results
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-90}
BENCH_BUDGET_S=${BENCH_BUDGET_S:-180}
RANKS_BUDGET_S=${RANKS_BUDGET_S:-450}  # 6 cases per world size (2, and 4 with 4+ GPUs)
OFFLOAD_BUDGET_S=${OFFLOAD_BUDGET_S:-180}

if [ ! -x "$PYTHON" ]; then
  echo "gpu_check: no Python at $PYTHON; run scripts/setup.sh first (or set PYTHON=...)" >&2
  exit 2
fi
if ! device=$("$PYTHON" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
    sys.exit(f"gpu_check: no CUDA device visible to torch {torch.__version__} ({build}); "
             "this check needs one NVIDIA GPU and a CUDA build of torch")
print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
); then
  exit 2
fi
echo "gpu_check: $device"
mkdir -p "$RESULTS"
started=$(date -u +%FT%TZ)
load_before=$(cut -d' ' -f1 /proc/loadavg)

# 1. The gpu-marked tests (they skip themselves without a device; here one is present).
set +e
tests_out=$(timeout "$TESTS_TIMEOUT_S" "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider \
  tests/worker tests/e2e/test_ray_fleet.py 2>&1)
tests_rc=$?
set -e
{
  echo "# GPU tests"
  echo
  echo "$started · $device · load average $load_before · \`pytest -m gpu tests/worker tests/e2e/test_ray_fleet.py\` (exit $tests_rc)"
  echo
  echo '```'
  echo "$tests_out" | tail -40
  echo '```'
} >"$RESULTS/gpu_tests.md"
echo "$tests_out" | tail -3

# 2. The GPU predictor benchmark on the zoo, bounded by its own case budget.
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
set +e
timeout $((BENCH_BUDGET_S + 60)) "$PYTHON" bench/predictor_accuracy.py --gpu \
  --budget-s "$BENCH_BUDGET_S" --out "$out"
bench_rc=$?
set -e
for ext in md json; do
  if [ -f "$out/predictor_accuracy_gpu.$ext" ]; then
    cp "$out/predictor_accuracy_gpu.$ext" "$RESULTS/gpu_predictor_accuracy.$ext"
  fi
done

# 3. The offload rungs (issue 32): each rung's prediction on fake cuda against the card's
#    max_memory_allocated, and its step time against as asked (bench/gpu_offload.py).
set +e
timeout "$OFFLOAD_BUDGET_S" "$PYTHON" bench/gpu_offload.py --out "$RESULTS"
offload_rc=$?
set -e

# 4. Per-rank prediction against NCCL ranks (bench/gpu_ranks.py), on a machine with 2+ GPUs.
ranks_rc=0
if [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  set +e
  timeout "$RANKS_BUDGET_S" "$PYTHON" bench/gpu_ranks.py --out "$RESULTS"
  ranks_rc=$?
  set -e
else
  echo "gpu_check: one GPU, so no per-rank run (bench/gpu_ranks.py needs 2 or more)"
fi
echo "gpu_check: wrote $RESULTS/gpu_tests.md, $RESULTS/gpu_predictor_accuracy.{md,json}" \
  "and $RESULTS/gpu_offload.{md,json} (tests exit $tests_rc, benchmark exit $bench_rc," \
  "offload exit $offload_rc, ranks exit $ranks_rc; load average $(cut -d' ' -f1 /proc/loadavg))"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$offload_rc" -eq 0 ] && [ "$ranks_rc" -eq 0 ]
