#!/usr/bin/env bash
# RDMA on real hardware: what the machine has, then two real clients on this machine
# moving 4 KiB, 64 KiB, 1 MiB and 64 MiB objects over loopback RDMA (one NIC, then two
# when there are several), next to perftest's ib_write_bw / ib_read_bw where installed.
#
#   benches/rdma_hardware.sh [bin_dir]     (default: target/release)
#
# bin_dir holds mooncake_bench, mooncake_client and mooncake_master (cargo build
# --release --bins). A machine without an RDMA device says so and exits 0.
set -u
bin_dir=${1:-target/release}
sizes=${MOONCAKE_BENCH_SIZES:-4KiB,64KiB,1MiB,64MiB}
repeats=${MOONCAKE_BENCH_REPEATS:-3}

echo "== ls /sys/class/infiniband"
ls /sys/class/infiniband 2>&1
echo "== ibv_devinfo"
if command -v ibv_devinfo >/dev/null; then ibv_devinfo 2>&1; else echo "ibv_devinfo not installed"; fi
devices=$(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ')
if [ -z "$devices" ]; then
  echo "no RDMA device on this machine (nothing under /sys/class/infiniband): nothing to measure"
  exit 0
fi
for binary in mooncake_bench mooncake_client mooncake_master; do
  [ -x "$bin_dir/$binary" ] || { echo "$bin_dir/$binary is missing: cargo build --release --bins" >&2; exit 1; }
done
ulimit -l unlimited 2>/dev/null || echo "warning: cannot raise the memlock limit (ulimit -l: $(ulimit -l))"
read -r first second _ <<<"$devices"

run_bench() { # $1: label, $2: device list
  echo "== mooncake-rs over RDMA, $1 ($2)"
  MOONCAKE_BENCH_PROTOCOL=rdma MOONCAKE_BENCH_RDMA_DEVICES="$2" MOONCAKE_BENCH_SIZES="$sizes" \
    "$bin_dir/mooncake_bench" --sections cluster --repeats "$repeats"
}
run_bench "one NIC" "$first"
if [ -n "${second:-}" ]; then run_bench "two NICs" "$first,$second"; fi

echo "== perftest references (loopback, one NIC)"
for tool in ib_write_bw ib_read_bw; do
  if ! command -v "$tool" >/dev/null; then echo "$tool not installed (apt install perftest)"; continue; fi
  for bytes in 4096 65536 1048576 67108864; do
    "$tool" -d "$first" -s "$bytes" -n 200 --report_gbits >/tmp/perftest-server.$$ 2>&1 &
    server=$!
    sleep 1
    echo "-- $tool $bytes bytes"
    "$tool" -d "$first" -s "$bytes" -n 200 --report_gbits 127.0.0.1 2>&1 | tail -3
    wait "$server" 2>/dev/null
  done
done
rm -f /tmp/perftest-server.$$

if command -v nvidia-smi >/dev/null; then
  echo "== GPU present: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo "GPUDirect is not built: GPU buffers travel through a host bounce buffer (docs/deployment.md#rdma)"
fi
