# cage's build. `make` builds bin/cage and bin/cage-agent (both static).
GO      ?= go
BIN     ?= bin
GOFLAGS_BUILD = -trimpath -ldflags '-s -w'

# gVisor's runsc at a pinned version that works on these hosts (systrap).
RUNSC_VERSION ?= v0.0.0-20260905035102-160fafc42237
RUNSC_DIR ?= $(CURDIR)/.tools/bin

.PHONY: all build demo test test-unit proto api vet fmt bench clean runsc base

all: build

build:
	CGO_ENABLED=0 $(GO) build $(GOFLAGS_BUILD) -o $(BIN)/cage ./cmd/cage
	CGO_ENABLED=0 $(GO) build $(GOFLAGS_BUILD) -o $(BIN)/cage-agent ./cmd/cage-agent

# The ready-made template "base" (Debian 12, python3, node, git, curl, the
# user account), made once from Debian's mirror and cached in the template
# store ($CAGE_TEMPLATES, else /var/lib/cage/templates).
base: build
	./bin/cage template build --net internet templates/base base

demo: build
	./scripts/demo.sh

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
