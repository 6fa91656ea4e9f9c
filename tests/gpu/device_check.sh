#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU and its driver (the device machine of the
# tool library, or any GPU node): builds mooncake_client and the Python package, runs
# the device test suite of the stand-in driver, then device_check.py in embedded and
# dummy mode. Results (JSON lines) go to $OUT/gpu_check.jsonl, or ./gpu_check.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-.}/gpu_check.jsonl"
log="${OUT:-.}/gpu_check.log"
: > "$out"
exec > >(tee -a "$log") 2>&1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
cargo build --release -p mooncake-real-client --bins
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q maturin numpy
(cd dummy_client/python && ../../.venv-gpu/bin/maturin develop --release -q)

.venv-gpu/bin/python tests/gpu/device_check.py embedded | tee -a "$out"

port=$((20000 + RANDOM % 20000))
target/release/mooncake_client --port="$port" --global_segment_size=2GB --log_level=info &
client=$!
trap 'kill $client 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  grep -q "mooncake_client_${port}.sock" /proc/net/unix && break
  sleep 0.1
done
.venv-gpu/bin/python tests/gpu/device_check.py dummy "$port" | tee -a "$out"
echo "gpu check done"
