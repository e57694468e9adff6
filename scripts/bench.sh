#!/usr/bin/env bash
# `cage bench` with every wall and every peer it measures against, on a
# fresh machine as on a warm one: installs bubblewrap (the peer of `cage
# run`), runc, QEMU and the guest kernel, builds runsc and the base
# template into the cache the tests use (scripts/walls.sh), then runs
# `cage bench` with the arguments given. Without arguments (the full run)
# it then measures gVisor's TCP throughput against the host's, the one
# row `cage bench` cannot take itself: it needs the test world's outside
# host (test/conformance's BenchmarkNetworkThroughput).
#
#   sudo make bench                          # the full run (a few minutes)
#   sudo make bench ARGS='--only serve --alive 1000'
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "bench.sh: cage bench starts sandboxes and needs root; run it with sudo" >&2
  exit 1
fi
need=()
command -v bwrap >/dev/null || need+=(bubblewrap) # the peer of `cage run -- true`
command -v runc >/dev/null || need+=(runc)        # the runc wall and its peer, raw `runc run`
command -v ip >/dev/null || need+=(iproute2)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap) # the base template (the microvm's)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
. scripts/walls.sh
walls_runsc
walls_kernel
make -s build
walls_base

rc=0
./bin/cage bench "$@" || rc=$?
if [ $# = 0 ]; then
  echo
  echo "gVisor TCP throughput against the host's (3 streams of 256 MiB each; the ratio of the medians):"
  out=$(mktemp)
  if go test -count=1 -run '^$' -bench 'NetworkThroughput/(gvisor|process)$' -benchtime 3x ./test/conformance >"$out" 2>&1; then
    grep '^Benchmark' "$out"
  else
    tail -20 "$out" >&2
    rc=1
  fi
  rm -f "$out"
fi
exit $rc
