#!/usr/bin/env bash
# scripts/kube.sh DIR [K8S_VERSION ETCD_VERSION]: builds a Kubernetes control
# plane for cage's cluster tests into DIR: static etcd, kube-apiserver and
# kube-scheduler, from the Go module proxy (no Docker, no release tarballs).
# The versions default to the Makefile's KUBE_VERSION and ETCD_VERSION.
#
# Each build happens in a throw-away Go module under DIR.tmp (never in cage's
# go.mod): kube-apiserver and kube-scheduler in one `go build` of
# k8s.io/kubernetes with its staging modules (k8s.io/api, apiserver, ...)
# replaced by their v0.<minor>.<patch> releases, which is how its own go.mod
# points them at ./staging; etcd as a three-line main that calls etcdmain.
# DIR appears only when all three binaries are built (DIR.tmp, then mv).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: scripts/kube.sh DIR [K8S_VERSION ETCD_VERSION]}
kube=${2:-$(sed -n 's/^KUBE_VERSION ?= //p' Makefile)}
etcd=${3:-$(sed -n 's/^ETCD_VERSION ?= //p' Makefile)}
go=${GO:-go}
staging=v0.${kube#v1.} # v1.37.2 -> v0.37.2

tmp="$dir.tmp"
rm -rf "$tmp"
mkdir -p "$tmp/bin" "$tmp/src/kube" "$tmp/src/etcd"
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOWORK=off GOTOOLCHAIN=local
# A build cache of its own (several GB of Kubernetes objects), removed with
# DIR.tmp's sources once the binaries are made; KUBE_GOCACHE names another.
export GOCACHE=${KUBE_GOCACHE:-$(realpath -m "$tmp/gocache")}
build=(build -trimpath -ldflags '-s -w')

# kube-apiserver and kube-scheduler. The replace lines come from
# k8s.io/kubernetes's own go.mod (every "k8s.io/X => ./staging/src/k8s.io/X"),
# so a new staging module in a later release is picked up without a list here.
(
  cd "$tmp/src/kube"
  cat >go.mod <<EOF
module cagekube

go 1.26

require k8s.io/kubernetes $kube
EOF
  modfile=$("$go" mod download -json "k8s.io/kubernetes@$kube" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
  [ -f "$modfile" ] || { echo "kube.sh: no go.mod for k8s.io/kubernetes@$kube" >&2; exit 1; }
  sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9.-]*\) => \./staging/.*#\1#p' "$modfile" | sort -u >staging.txt
  [ -s staging.txt ] || { echo "kube.sh: no staging modules in $modfile" >&2; exit 1; }
  while read -r m; do
    echo "replace $m => $m $staging" >>go.mod
  done <staging.txt
  cat >tools.go <<'EOF'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
EOF
  "$go" mod tidy -e >/dev/null 2>&1 || true
  v=k8s.io/component-base/version
  minor=${kube#v1.}
  "$go" build -trimpath -ldflags "-s -w -X $v.gitVersion=$kube -X $v.gitMajor=1 -X $v.gitMinor=${minor%%.*} -X $v.gitTreeState=clean" \
    -o ../../bin/ k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler
)

# etcd: the server module's etcdmain, which is all the etcd command does.
(
  cd "$tmp/src/etcd"
  cat >go.mod <<EOF
module cageetcd

go 1.26

require go.etcd.io/etcd/server/v3 $etcd
EOF
  cat >main.go <<'EOF'
// Command etcd runs etcd's server (go.etcd.io/etcd/server/v3/etcdmain).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
  "$go" mod tidy >/dev/null
  "$go" "${build[@]}" -o ../../bin/etcd .
)

for b in etcd kube-apiserver kube-scheduler; do
  [ -x "$tmp/bin/$b" ] || { echo "kube.sh: $b was not built" >&2; exit 1; }
done
rm -rf "$tmp/src" "$tmp/gocache"
mv "$tmp/bin"/* "$tmp/" && rmdir "$tmp/bin"
printf 'kubernetes %s\netcd %s\n' "$kube" "$etcd" >"$tmp/VERSIONS"
rm -rf "$dir"
mv "$tmp" "$dir"
echo "$dir"
