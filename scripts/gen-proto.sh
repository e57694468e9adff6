#!/usr/bin/env bash
# Regenerates the Go code under api/gen from the .proto files under api/proto.
# One command: scripts/gen-proto.sh (installs protoc and the Go plugins if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v protoc >/dev/null; then
  apt-get update -qq && apt-get install -y -qq protobuf-compiler >/dev/null
fi
bin="$PWD/.tools/bin"
mkdir -p "$bin"
GOBIN="$bin" go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
GOBIN="$bin" go install connectrpc.com/connect/cmd/protoc-gen-connect-go@v1.19.1
rm -rf api/gen
mkdir -p api/gen
PATH="$bin:$PATH" protoc -I api/proto \
  --go_out=api/gen --go_opt=paths=source_relative \
  --connect-go_out=api/gen --connect-go_opt=paths=source_relative \
  api/proto/process/process.proto api/proto/filesystem/filesystem.proto
