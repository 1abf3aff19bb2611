#!/usr/bin/env bash
# Device check of the CUDA path (docs/cuda.md), on a machine with one GPU:
#
#   scripts/device_check.sh            install from this checkout, run the CUDA tests,
#                                      benchmark 8 GiB of bf16 GPU -> GPU across two
#                                      processes, print one table (under 5 minutes)
#   scripts/device_check.sh --cpu      the same steps on CPU with tiny sizes, staging
#                                      through the fake copy engine; installs nothing
#                                      (alias: --dry-run). tests/test_device.py runs it.
#
# Environment:
#   PYTHON      interpreter to use (default: python3). On the GPU machine it must
#               already have a CUDA build of torch: this script never installs or
#               replaces torch (pip runs with a constraint pinning the installed
#               version; the repository's constraints.txt, which pins the CPU wheel
#               for CI, is not used here).
#   WHEELHOUSE  a directory of wheels (pyzmq, msgpack, pytest, torchft) to install
#               from when the machine has no network; otherwise pip's index is used
#               for whatever is missing. torchft is optional: without it the
#               HTTPTransport row says why it was skipped.
#   BENCH_ARGS  extra arguments for scripts/device_bench.py (e.g. "--total 2GiB").
#
# Exit status: 0 when the CUDA tests pass and every transfer is bit-exact.
set -euo pipefail

MODE=gpu
case "${1:-}" in
  --cpu | --dry-run) MODE=cpu ;;
  "") ;;
  -h | --help) sed -n '2,25p' "$0"; exit 0 ;;
  *) echo "usage: $0 [--cpu|--dry-run]" >&2; exit 2 ;;
esac

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PYTHON=${PYTHON:-python3}
LOG=$(mktemp -d "${TMPDIR:-/tmp}/device_check.XXXXXX")
export ZMQT_DEVICE_CHECK=1        # tells tests/test_device.py not to run this script again
export RUST_LOG=${RUST_LOG:-warn} # torchft's Rust logging
unset PIP_CONSTRAINT              # never let CI's CPU-torch pin reach this machine's pip
started=$SECONDS

say() { printf '[device_check +%3ds] %s\n' "$((SECONDS - started))" "$*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

have() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }

pip_install() {
  # With a constraint pinning the torch already installed: whatever the
  # packages require, pip may not replace this machine's CUDA build of torch.
  local args=(-m pip install --quiet --disable-pip-version-check --constraint "$LOG/keep-torch.txt")
  if [[ -n "${WHEELHOUSE:-}" ]]; then args+=(--no-index --find-links "$WHEELHOUSE"); fi
  timeout 90 "$PYTHON" "${args[@]}" "$@"
}

# ---------------------------------------------------------------- 1. environment
"$PYTHON" -c 'import torch' 2>/dev/null || fail "$PYTHON has no torch (install a CUDA build of torch first)"
if [[ $MODE == gpu ]]; then
  "$PYTHON" - <<'EOF' || fail "torch.cuda.is_available() is False: no usable GPU, or a CPU-only torch (use --cpu)"
import sys, torch
sys.exit(0 if torch.cuda.is_available() else 1)
EOF
  "$PYTHON" -c 'import torch; print(f"torch=={torch.__version__}")' >"$LOG/keep-torch.txt"
  for module in zmq:pyzmq msgpack:msgpack pytest:pytest; do
    have "${module%%:*}" || { say "installing ${module#*:}"; pip_install "${module#*:}" || fail "cannot install ${module#*:}"; }
  done
  have torchft || { say "installing torchft (optional)"; pip_install torchft >/dev/null 2>&1 || say "torchft unavailable: HTTPTransport row skipped"; }
  # Editable, no dependencies, no build isolation (which would fetch setuptools):
  # the installed package is this checkout, running on this machine's torch.
  if ! timeout 90 "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation --disable-pip-version-check -e . \
      >"$LOG/install.log" 2>&1; then
    say "pip install -e . failed (see below); using PYTHONPATH=$REPO instead"
    tail -5 "$LOG/install.log" >&2
  fi
fi
# Import from this checkout whatever pip did (CPU mode installs nothing).
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" - >&2 <<'EOF' || fail "the environment is not usable"
import torch, zmq, msgpack, zmqtransport
cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, GPU: {cuda}), pyzmq {zmq.__version__}, "
      f"zmqtransport from {zmqtransport.__file__}")
EOF

# ---------------------------------------------------------------- 2. CUDA tests
say "running the CUDA tests of tests/test_device.py and tests/test_disallow.py"
set +e
timeout 180 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_disallow.py -k cuda -rs >"$LOG/pytest.log" 2>&1
tests_rc=$?
set -e
summary=$(grep -E '^=* ?[0-9]+ (passed|failed|skipped|error|deselected)|no tests ran' "$LOG/pytest.log" | tail -1 |
  sed -E 's/^=+ //; s/ =+$//' || true)
if [[ $tests_rc -ne 0 && $tests_rc -ne 5 ]]; then
  cat "$LOG/pytest.log" >&2
  fail "CUDA tests (exit $tests_rc): $summary"
fi
if [[ $MODE == gpu ]] && grep -q skipped <<<"$summary"; then
  cat "$LOG/pytest.log" >&2
  fail "CUDA tests were skipped on a GPU machine: $summary"
fi

# ---------------------------------------------------------------- 3. benchmark
if [[ $MODE == gpu ]]; then
  bench=(--device cuda --total 8GiB --tensor-bytes 256MiB --chunk-bytes 4MiB --repeats 2 --http-repeats 1 --timeout 90)
else
  bench=(--device cpu --total 16MiB --tensor-bytes 2MiB --chunk-bytes 256KiB --repeats 1 --fake-staging --timeout 60)
fi
# shellcheck disable=SC2206  # BENCH_ARGS is split on purpose
bench+=(${BENCH_ARGS:-})
say "benchmark: scripts/device_bench.py ${bench[*]}"
set +e
timeout 200 "$PYTHON" scripts/device_bench.py "${bench[@]}" \
  --note "CUDA tests: ${summary:-no summary} | mode: $MODE | total $((SECONDS - started)) s before the benchmark"
bench_rc=$?
set -e
say "done in $((SECONDS - started)) s"
[[ $bench_rc -eq 0 ]] || fail "benchmark (exit $bench_rc)"
rm -rf "$LOG"
