# What every wall needs on this host, kept in a cache outside the clone:
# sourced by scripts/test.sh and scripts/bench.sh, from the repository's
# root. What is slow to make (runsc, the guest kernel, the base template)
# is kept in $CAGE_DEV_CACHE (default /var/cache/cage-dev, or
# ~/.cache/cage-dev when not root), each under a key of its inputs: a warm
# machine reuses it, a fresh one (or changed inputs) builds it again.
if [ "$(id -u)" = 0 ]; then cache=${CAGE_DEV_CACHE:-/var/cache/cage-dev}; else cache=${CAGE_DEV_CACHE:-$HOME/.cache/cage-dev}; fi
mkdir -p "$cache" .tools/bin

# walls_runsc: gVisor's runsc, built from the Go module proxy at the
# version the Makefile pins (static; a cgo build fails at start), unless
# CAGE_RUNSC names one.
walls_runsc() {
  if [ -z "${CAGE_RUNSC:-}" ]; then
    local runsc_dir
    runsc_dir="$cache/runsc-$(sed -n 's/^RUNSC_VERSION ?= //p' Makefile)"
    export CAGE_RUNSC="$runsc_dir/runsc"
    if [ ! -x "$CAGE_RUNSC" ]; then
      echo "== building runsc (gVisor) from the module proxy (about 2 minutes, once per version)"
      rm -rf "$runsc_dir.tmp"
      make -s runsc RUNSC_DIR="$runsc_dir.tmp" && rm -rf "$runsc_dir" && mv "$runsc_dir.tmp" "$runsc_dir"
    fi
    ln -sfn "$CAGE_RUNSC" .tools/bin/runsc
  fi
}

# walls_kernel: the microvm wall's guest kernel (Debian's cloud kernel,
# one directory per kernel version) and QEMU (root only).
walls_kernel() {
  if [ "$(id -u)" = 0 ]; then
    export CAGE_KERNEL_DIR="${CAGE_KERNEL_DIR:-$cache/kernel}"
    echo "== guest kernel $(bash scripts/kernel.sh "$CAGE_KERNEL_DIR") and QEMU"
  fi
}

# walls_base: the ready-made template "base", built once from Debian's
# mirror (about two minutes) into a template store kept in the cache
# (root only; bin/cage must be built).
walls_base() {
  if [ "$(id -u)" = 0 ]; then
    # The store's key: what makes and reads it (the Dockerfile, the store
    # and build code). Stores of older keys go after a week unused.
    local key
    key=$(git ls-files -s templates/base internal/imgstore internal/build internal/template | sha256sum | cut -c1-16)
    export CAGE_TEMPLATES="${CAGE_TEMPLATES:-$cache/templates-$key}"
    find "$cache" -maxdepth 1 -name 'templates-*' ! -name "templates-$key" -mtime +7 -exec rm -rf {} + 2>/dev/null || true
    if ! ./bin/cage template inspect base >/dev/null 2>&1; then
      echo "== building the base template (Debian 12 from Debian's mirror, once per key)"
      ./bin/cage template build --net internet templates/base base >.tools/base-build.log 2>&1 ||
        { tail -30 .tools/base-build.log >&2; exit 1; }
    fi
    touch "$CAGE_TEMPLATES"
  fi
}
