# cage's build. `make` builds bin/cage, bin/cage-agent and bin/cage-interp
# (all static).
GO      ?= go
BIN     ?= bin
GOFLAGS_BUILD = -trimpath -ldflags '-s -w'

# gVisor's runsc at a pinned version that works on these hosts (systrap).
RUNSC_VERSION ?= v0.0.0-20260905035102-160fafc42237
RUNSC_DIR ?= $(CURDIR)/.tools/bin

# The Kubernetes control plane of the cluster tests (scripts/kube.sh builds
# etcd, kube-apiserver and kube-scheduler from the module proxy).
KUBE_VERSION ?= v1.37.2
ETCD_VERSION ?= v3.7.3

.PHONY: all build demo test test-unit proto api vet fmt bench clean runsc base code-interpreter desktop

all: build

build:
	CGO_ENABLED=0 $(GO) build $(GOFLAGS_BUILD) -o $(BIN)/cage ./cmd/cage
	CGO_ENABLED=0 $(GO) build $(GOFLAGS_BUILD) -o $(BIN)/cage-agent ./cmd/cage-agent
	CGO_ENABLED=0 $(GO) build $(GOFLAGS_BUILD) -o $(BIN)/cage-interp ./cmd/cage-interp

# The ready-made template "base" (Debian 12, python3, node, git, curl, the
# user account), made once from Debian's mirror and cached in the template
# store ($CAGE_TEMPLATES, else /var/lib/cage/templates).
base: build
	./bin/cage template build --net internet templates/base base

# The template "code-interpreter-v1" (@e2b/code-interpreter's default): base
# with Debian's Python data stack, R, TypeScript and bin/cage-interp, built
# from templates/code-interpreter with the binary added to the context. Its
# steps are cached: again, it rebuilds only what changed (cage-interp: the
# last layers).
code-interpreter: build
	rm -rf .tools/code-interpreter && mkdir -p .tools
	cp -r templates/code-interpreter .tools/code-interpreter && cp $(BIN)/cage-interp .tools/code-interpreter/
	./bin/cage template build --net internet .tools/code-interpreter code-interpreter-v1

# The template "desktop" (@e2b/desktop's default): base with Xvfb, XFCE,
# xdotool, scrot, x11vnc, noVNC, Firefox ESR and Mousepad from Debian 12.
# Its steps are cached like code-interpreter's.
desktop: build
	./bin/cage template build --net internet templates/desktop desktop

demo: build
	./scripts/demo.sh

# cage bench with every wall and peer set up (root; scripts/bench.sh).
bench:
	./scripts/bench.sh $(ARGS)

test:
	./scripts/test.sh

proto:
	./scripts/gen-proto.sh

# api/types, the control API's Go types, from api/openapi.yaml.
api:
	./scripts/gen-api.sh

runsc:
	mkdir -p $(RUNSC_DIR)
	CGO_ENABLED=0 GOBIN=$(RUNSC_DIR) $(GO) install gvisor.dev/gvisor/runsc@$(RUNSC_VERSION)

vet:
	$(GO) vet ./...

fmt:
	gofmt -l -w $$(git ls-files '*.go')

clean:
	rm -rf $(BIN)

# The dashboard's xterm.js (internal/ui/static/vendor), refreshed from the
# releases test/ui/package.json pins (npm ci there); test/ui's
# TestVendoredXterm fails while the copy differs from them.
.PHONY: ui
ui:
	cd test/ui && npm ci --no-audit --no-fund
	cp test/ui/node_modules/@xterm/xterm/lib/xterm.js test/ui/node_modules/@xterm/xterm/css/xterm.css \
	  test/ui/node_modules/@xterm/addon-fit/lib/addon-fit.js internal/ui/static/vendor/
	cp test/ui/node_modules/@xterm/xterm/LICENSE internal/ui/static/vendor/xterm.LICENSE
	cp test/ui/node_modules/@xterm/addon-fit/LICENSE internal/ui/static/vendor/addon-fit.LICENSE
