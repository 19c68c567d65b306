#!/usr/bin/env bash
# GPU check of the curvature engine (issue 3), for a CUDA machine without network:
# Python 3.12 with torch, torchvision, scipy, numpy, pytest, typer, rich, pyyaml,
# scikit-learn preinstalled. Pure-Python wheels that the image lacks travel in
# .whl/ (git-ignored; carry it): pyhessian, curvlinops-for-pytorch,
# backpack-for-pytorch, einconv, unfoldNd. Fill it on a machine with network:
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       pyhessian curvlinops-for-pytorch backpack-for-pytorch einconv unfoldNd
#
# Run from the repository root:  bash tools/gpu_check.sh
# Logs go to $OUT (default /tmp/gpu_check). Each stage has its own time limit; with the
# default limits the whole script stays under 9.5 minutes (one device call of at most 10).
# STAGES picks stages (default: tests trace lambda catalogue). The catalogue stage
# (benchmarks/bench_catalogue.py, issue 10: training, every measure, flatcli vs PyHessian) needs an
# estimated 5-6 minutes for all its rows when the catalogue meets its 120 s target (estimated from
# the issue's PyHessian timings, not yet measured on a GPU); at the default T_CATALOGUE it stops
# starting rows at its deadline and lists the rest as skipped. The whole table in one call:
#   STAGES=catalogue T_CATALOGUE=560 CATALOGUE_BUDGET=240 bash tools/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
T0=$(date +%s)
stage() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }

stage "install wheels into /tmp/site"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1 \
    || stage "pip install failed (see pip.log); peers will be skipped"
else
  stage "no .whl/ directory: PyHessian and curvlinops rows will be skipped"
fi
export PYTHONPATH=/tmp/site:$PWD
export PYTHONDONTWRITEBYTECODE=1

{ nvidia-smi; python3 -c "import sys, torch, torchvision; print(sys.version); print('torch', torch.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name())"; \
  python3 -c "import pyhessian, curvlinops; print('pyhessian ok; curvlinops', curvlinops.__file__)"; } >"$OUT/env.txt" 2>&1
stage "env: $(tail -n 2 "$OUT/env.txt" | head -n 1)"

# Stage limits (seconds) and sizes can be overridden from the environment, e.g. for a
# short device lease: T_TESTS=45 T_TRACE=110 T_LAMBDA=60 PROBES=256 bash tools/gpu_check.sh
T_TESTS=${T_TESTS:-80}; T_TRACE=${T_TRACE:-150}; T_LAMBDA=${T_LAMBDA:-90}; PROBES=${PROBES:-400}
# catalogue stage: hard limit, catalogue budget (measures starting after it are skipped)
T_CATALOGUE=${T_CATALOGUE:-220}; CATALOGUE_BUDGET=${CATALOGUE_BUDGET:-120}
STAGES=${STAGES:-"tests trace lambda catalogue"}
want() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if want tests; then
stage "pytest -m gpu tests/ (engine, measures, landscape, sweep on CUDA)"
timeout "$T_TESTS" python3 -m pytest -q -m gpu tests/ -p no:cacheprovider -o addopts="" >"$OUT/pytest_gpu.log" 2>&1
stage "  rc=$? $(tail -n 1 "$OUT/pytest_gpu.log")"
fi

BENCH=(python3 -m benchmarks.bench_engine --device cuda --n 5000 --batch-size 500 --repeats 1)
if want trace; then
stage "bench: trace to 1% stderr (ResNet-18, 5000 inputs)"
timeout "$T_TRACE" "${BENCH[@]}" --tasks resnet-trace --max-probes "$PROBES" --ref-probes "$PROBES" \
  --json "$OUT/bench_gpu_trace.json" >"$OUT/bench_gpu_trace.log" 2>&1
stage "  rc=$?"
fi

if want lambda; then
stage "bench: HVP variants + lambda_max to 1e-4 (ResNet-18, 5000 inputs)"
timeout "$T_LAMBDA" "${BENCH[@]}" --tasks resnet-lambda,resnet-variants --pyhessian-tight-iters 100 --ref-steps 100 \
  --json "$OUT/bench_gpu_lambda.json" >"$OUT/bench_gpu_lambda.log" 2>&1
stage "  rc=$?"
fi

if want catalogue; then
stage "bench: catalogue + flatcli vs PyHessian (ResNet-18 trained on 5000 inputs; limit ${T_CATALOGUE}s)"
# the script stops starting rows 20 s before the hard limit; rows are written as they finish
timeout "$T_CATALOGUE" python3 -m benchmarks.bench_catalogue --device cuda --n 5000 --batch-size 500 \
  --budget-s "$CATALOGUE_BUDGET" --deadline-s "$(( T_CATALOGUE - 20 ))" --out "$OUT/catalogue" --json "$OUT/catalogue.json" \
  >"$OUT/bench_catalogue.log" 2>&1
stage "  rc=$? $(grep -m1 '^| \*\*total' "$OUT/catalogue/catalogue.md" 2>/dev/null)"
fi
stage "done; results in $OUT/bench_gpu_*.json and $OUT/catalogue.json (copy them to docs/benchmarks/data/; rows of runs cut short are in the .log files)"
