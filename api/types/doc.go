// Package types is the control API's wire schema in Go: the request and
// response bodies of api/openapi.yaml, generated from it by oapi-codegen
// (types.gen.go; `make api` writes it again, and this package's test fails
// while it is stale). The server (internal/api), the CLI's client
// (internal/client) and the daemon's tests all use these types, so none of
// them keeps a copy of its own.
//
// Sizes are in MiB here because they are on the wire (memoryMB,
// diskSizeMB); the rest of cage counts bytes.
package types

//go:generate ../../scripts/gen-api.sh
