#!/usr/bin/env bash
# Regenerates api/types/types.gen.go, the Go types of the control API, from
# api/openapi.yaml with oapi-codegen at the version tools/go.mod pins (a
# module of its own, so none of the generator's dependencies enter cage's).
# One command: scripts/gen-api.sh (make api). api/types' test fails while
# the committed file differs from what this writes.
set -euo pipefail
cd "$(dirname "$0")/../tools"
go tool oapi-codegen -config ../api/types/oapi-codegen.yaml -o ../api/types/types.gen.go ../api/openapi.yaml
