# cage's build. `make` builds bin/cage and bin/cage-agent (both static).
GO      ?= go
BIN     ?= bin
GOFLAGS_BUILD = -trimpath -ldflags '-s -w'

.PHONY: all build demo test test-unit proto vet fmt bench clean

all: build

build:
	CGO_ENABLED=0 $(GO) build $(GOFLAGS_BUILD) -o $(BIN)/cage ./cmd/cage
	CGO_ENABLED=0 $(GO) build $(GOFLAGS_BUILD) -o $(BIN)/cage-agent ./cmd/cage-agent

demo: build
	./scripts/demo.sh

test:
	./scripts/test.sh

proto:
	./scripts/gen-proto.sh

vet:
	$(GO) vet ./...

fmt:
	gofmt -l -w $$(git ls-files '*.go')

clean:
	rm -rf $(BIN)
