#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what the tests need, checks
# formatting and vet, then runs every package's tests (integration tests need
# root; without it they skip and say so).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v python3 >/dev/null || need+=(python3)
command -v ps >/dev/null || need+=(procps)
command -v unshare >/dev/null || need+=(util-linux)
command -v ip >/dev/null || need+=(iproute2)
command -v runc >/dev/null || need+=(runc)
[ -x /bin/busybox ] || need+=(busybox-static) # the test images' one binary
python3 -c 'import ipykernel' 2>/dev/null || need+=(python3-ipykernel) # internal/interp's tests talk to a real kernel
command -v mmdebstrap >/dev/null || need+=(mmdebstrap) # FROM debian:bookworm (the base template)
command -v certutil >/dev/null || need+=(libnss3-tools) # test/e2b's desktop test: chromium trusts cage's CA through an NSS db
[ -x /usr/bin/chromium ] || need+=(chromium) # test/ui drives the dashboard in it
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "test.sh: missing ${need[*]}; install them (apt-get install ${need[*]})" >&2
    exit 1
  fi
fi
if [ "$(id -u)" != 0 ]; then
  echo "test.sh: not root: the integration tests (sandboxes) will be skipped; run with sudo for the full suite" >&2
fi

# runsc, the guest kernel and QEMU (and, below, the base template), from
# the cache outside the clone (scripts/walls.sh).
. scripts/walls.sh
walls_runsc
walls_kernel
# The Kubernetes control plane of the cluster tests (etcd, kube-apiserver,
# kube-scheduler from the module proxy; about 10 minutes on 2 cores, once
# per version pair). Not root: the cluster tests skip.
if [ "$(id -u)" = 0 ] && [ -z "${CAGE_KUBE_DIR:-}" ]; then
  kube_dir="$cache/kube-$(sed -n 's/^KUBE_VERSION ?= //p' Makefile)-etcd-$(sed -n 's/^ETCD_VERSION ?= //p' Makefile)"
  if [ ! -x "$kube_dir/kube-apiserver" ]; then
    echo "== building etcd, kube-apiserver and kube-scheduler from the module proxy (once per version)"
    bash scripts/kube.sh "$kube_dir" >/dev/null
  fi
  export CAGE_KUBE_DIR="$kube_dir"
fi
# As root (CI) every wall must run: a missing one fails the suite instead of
# being skipped.
if [ "$(id -u)" = 0 ]; then
  export CAGE_REQUIRE_WALLS="${CAGE_REQUIRE_WALLS-process,runc,gvisor,microvm}"
fi

echo "== gofmt"
bad=$(gofmt -l $(git ls-files '*.go'))
if [ -n "$bad" ]; then echo "gofmt would change: $bad" >&2; exit 1; fi
echo "== go vet"
go vet ./...
echo "== build"
make -s build
# The ready-made template "base" (scripts/walls.sh), for the tests that
# start sandboxes of it (python3 and node through the E2B SDK).
walls_base
if [ "$(id -u)" = 0 ]; then
  export CAGE_REQUIRE_BASE=1
  # code-interpreter-v1 (@e2b/code-interpreter's template): base and
  # Debian's data stack (about five minutes the first time), then cached
  # step by step: a later run rebuilds only what changed (cage-interp).
  echo "== the code-interpreter-v1 template (cached steps are not run again)"
  make -s code-interpreter >.tools/code-interpreter-build.log 2>&1 ||
    { tail -30 .tools/code-interpreter-build.log >&2; exit 1; }
  export CAGE_REQUIRE_CODE_INTERPRETER=1
  # desktop (@e2b/desktop's template): base with Xvfb, XFCE, x11vnc, noVNC,
  # Firefox ESR (about two minutes the first time), cached the same way.
  echo "== the desktop template (cached steps are not run again)"
  make -s desktop >.tools/desktop-build.log 2>&1 ||
    { tail -30 .tools/desktop-build.log >&2; exit 1; }
  export CAGE_REQUIRE_DESKTOP=1

  # The E2B SDK from npm (test/e2b), installed here and not by the tests:
  # they run in network namespaces of their own, where the registry does
  # not resolve. The stamp says which package-lock.json it matches.
  node_major=$(node --version 2>/dev/null | sed -n 's/^v\([0-9]*\).*/\1/p')
  if [ "${node_major:-0}" -lt 20 ] || ! command -v npm >/dev/null; then
    echo "test.sh: the E2B SDK tests need Node.js 20 or later with npm (found: $(node --version 2>&1 | head -1))" >&2
    exit 1
  fi
  if ! (cd test/e2b && sha256sum --status -c node_modules/.cage-lock-sha256 2>/dev/null); then
    echo "== npm ci in test/e2b (the E2B SDK)"
    (cd test/e2b && npm ci --no-audit --no-fund >/dev/null &&
      sha256sum package.json package-lock.json >node_modules/.cage-lock-sha256)
  fi
  export CAGE_REQUIRE_E2B=1
  # test/ui: playwright-core (drives chromium) and the xterm.js releases
  # the dashboard vendors, pinned by its package-lock.json.
  if ! (cd test/ui && sha256sum --status -c node_modules/.cage-lock-sha256 2>/dev/null); then
    echo "== npm ci in test/ui (playwright-core, xterm.js)"
    (cd test/ui && npm ci --no-audit --no-fund >/dev/null &&
      sha256sum package.json package-lock.json >node_modules/.cage-lock-sha256)
  fi
  export CAGE_REQUIRE_UI=1
  # internal/interp's kernels: python3-ipykernel (above), node, and
  # TypeScript from test/e2b's packages.
  export CAGE_REQUIRE_KERNELS=1
fi
# The generators whose output is committed (api/types' test checks it is
# current), fetched here: the tests run them offline.
(cd tools && go mod download)
export CAGE_REQUIRE_TOOLS=1

# Every fuzz target, for a bounded time each (FUZZTIME, default 10s):
# what their seed corpora hold runs in `go test` below too.
echo "== fuzz (${FUZZTIME:-10s} per target)"
fuzzlog=$(mktemp)
for pkg in $(git grep -l '^func Fuzz' -- '*_test.go' | xargs -n1 dirname | sort -u); do
  for fn in $(git grep -h -o '^func Fuzz[A-Za-z0-9_]*' -- "$pkg/*_test.go" | sed 's/^func //'); do
    fuzzone() { go test -run '^$' -fuzz "^$fn\$" -fuzztime "${FUZZTIME:-10s}" "./$pkg" >"$fuzzlog" 2>&1; }
    fuzzfail() { tail -40 "$fuzzlog" >&2; echo "fuzz $pkg $fn failed" >&2; exit 1; }
    if ! fuzzone; then
      # Go 1.26's coordinator can report its own -fuzztime deadline as a
      # failure when a worker is slow to stop (go.dev/issue/75804, fixed in
      # Go 1.27): a bare "context deadline exceeded" with no input written.
      # That one case runs again; a finding writes its input and fails here.
      if grep -q 'Failing input written' "$fuzzlog" ||
        [ "$(grep -c -v -e '^fuzz: ' -e '^--- FAIL: ' -e '^    context deadline exceeded$' \
          -e '^FAIL$' -e '^exit status 1$' -e '^FAIL[[:space:]]' "$fuzzlog")" != 0 ] ||
        ! grep -q '^    context deadline exceeded$' "$fuzzlog"; then
        fuzzfail
      fi
      echo "fuzz $pkg $fn: Go's deadline race, no input found; once more"
      fuzzone || fuzzfail
    fi
  done
done
echo "== go test"
# One package at a time: the integration suites count what is on the host
# (processes, cgroups, namespaces) and must not see each other's sandboxes.
go test -count=1 -p 1 -timeout 25m ./... "$@"
