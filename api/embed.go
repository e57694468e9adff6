// Package api holds cage's API descriptions: the OpenAPI document of the
// REST control API that `cage serve` answers (openapi.yaml, embedded here),
// and the .proto files of the in-sandbox agent (proto/, generated Go in gen/).
package api

import _ "embed"

// OpenAPI is api/openapi.yaml, the OpenAPI 3.0 document of cage's control
// API. internal/apispec parses and validates it.
//
//go:embed openapi.yaml
var OpenAPI []byte
