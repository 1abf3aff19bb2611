#!/usr/bin/env bash
# The swarm lab on a many-core machine (issues 33 and 35): the rows this
# project's two-core VM cannot carry, each as one benchmark run written to
# $OUT (or ./device_swarm_out):
#
#   1. 11 receivers at 400 Mbit/s, 64 MiB (issue 33's 1.4x target, there
#      CPU-bound on two cores);
#   2. three receivers at 400 Mbit/s, a member's CPU per GiB against a
#      direct receive's (issue 33's 1.5x target);
#   3. 31 and 63 receivers at 100 Mbit/s, 64 MiB: link-bound with 16 cores,
#      63 past fetch.peers.MAX_PEERS (each member keeps a random half of the
#      members it hears of), for the model's prediction beside them
#      (`python -m zmqtransport.sim --receivers N --mib 64 --rate-mbit 100
#      --shared-cores 16 --tbf`).
#
# Needs root (network namespaces, tc). Environment:
#   PYTHON      interpreter (default python3) with torch already installed
#   WHEELHOUSE  wheels for what is missing (pyzmq, msgpack, torchft); default ./.whl
#   IPROUTE     a directory with bin/ip, bin/tc and their lib/ (default ./.iproute),
#               for an image without iproute2
#   ONLY        space-separated step numbers to run (default "1 2 3")
#   CODE        the directory whose zmqtransport package runs (default this checkout;
#               another tree's copy for an A/B on the same machine)
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$REPO/device_swarm_out}
WHEELHOUSE=${WHEELHOUSE:-$REPO/.whl}
IPROUTE=${IPROUTE:-$REPO/.iproute}
ONLY=${ONLY:-1 2 3}
mkdir -p "$OUT"
export PYTHONPATH="${CODE:-$REPO}${PYTHONPATH:+:$PYTHONPATH}"
unset PIP_CONSTRAINT
started=$SECONDS
say() { printf '[device_swarm +%3ds] %s\n' "$((SECONDS - started))" "$*" | tee -a "$OUT/log.txt" >&2; }

if ! command -v tc >/dev/null && [[ -x $IPROUTE/bin/tc ]]; then
  export PATH="$IPROUTE/bin:$PATH" LD_LIBRARY_PATH="$IPROUTE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "iproute2 from $IPROUTE"
fi
for module in zmq msgpack torchft; do
  if ! "$PYTHON" -c "import $module" 2>/dev/null; then
    "$PYTHON" -c 'import torch; print(f"torch=={torch.__version__}")' > "$OUT/keep-torch.txt"
    timeout 120 "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index \
      --find-links "$WHEELHOUSE" --constraint "$OUT/keep-torch.txt" \
      "$([[ $module == zmq ]] && echo pyzmq || echo $module)" 2>&1 | tail -3
  fi
done
nproc > "$OUT/nproc.txt"
(cd "${CODE:-$REPO}" && "$PYTHON" -c 'import sys, torch, zmq, zmqtransport; print(sys.version.split()[0], torch.__version__, zmq.__version__, zmqtransport.__file__)') | tee -a "$OUT/log.txt"

bench() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  say "$name: python -m zmqtransport.bench $*"
  (cd "${CODE:-$REPO}" && timeout "$limit" "$PYTHON" -m zmqtransport.bench "$@" --detail) > "$OUT/$name.txt" 2> "$OUT/$name.err"
  say "$name: exit $? ($(grep -c 'trial .* done' "$OUT/$name.err" 2>/dev/null || echo 0) trials)"
}

for step in $ONLY; do
  case $step in
    1) bench lab11 150 --scenario lab-1to7 --receivers 11 --methods zmq-fresh,zmq-inplace --reps 3 ;;
    2) bench lab3cpu 100 --scenario lab-1to3 --methods zmq-fresh,zmq-norelay --reps 3 ;;
    3) bench lab31 100 --scenario lab-1to7 --receivers 31 --rate 100 --methods zmq-fresh --reps 2
       bench lab63 150 --scenario lab-1to7 --receivers 63 --rate 100 --methods zmq-fresh --reps 2 ;;
  esac
done
say "done"
