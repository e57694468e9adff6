#!/usr/bin/env bash
# The demo: runs untrusted-looking Python in a fresh sandbox on the process
# wall and shows what it can and cannot see of this host.
set -euo pipefail
cd "$(dirname "$0")/.."
CAGE=./bin/cage
if [ "$(id -u)" != 0 ]; then CAGE="sudo ./bin/cage"; fi

echo "\$ cage run -- python3 -c '...'"
$CAGE run -- python3 -c '
import os, socket
print("hello from", socket.gethostname(), "as uid", os.getuid())
for p in ["/root", "/home", "/var", "/run", "/sys"]:
    try:
        print(f"  {p:6} ->", sorted(os.listdir(p)) or "empty")
    except OSError as e:
        print(f"  {p:6} ->", e.strerror)
print("  processes I can see:", sorted(int(d) for d in os.listdir("/proc") if d.isdigit()))
try:
    socket.create_connection(("1.1.1.1", 53), timeout=1)
    print("  network: reachable")
except OSError as e:
    print("  network:", e.strerror or e)
'
echo
echo "\$ cage run --memory 64M -- python3 -c 'bytearray(1 << 30)'"
$CAGE run --memory 64M -- python3 -c 'bytearray(1 << 30)' || echo "(exit code $?)"
