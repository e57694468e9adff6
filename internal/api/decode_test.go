package api

import (
	"errors"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/cagehq/cage/api/types"
)

// A body whose field has the wrong JSON type is a 400 that names the
// field, what it wants and what it got, in the API's words: Go's own
// message named this program's types and fields ("Go struct field
// NewSandboxV2.cpuCount of type float64").
func TestDecodeWrongTypeInAPIWords(t *testing.T) {
	for _, c := range []struct{ body, want string }{
		{`{"templateID":"host","cpuCount":"two"}`, "field cpuCount: want a number, got string"},
		{`{"templateID":5}`, "field templateID: want a string, got number"},
		{`{"templateID":"host","metadata":[1]}`, "field metadata: want an object, got array"},
		{`[1,2]`, "the body: want an object, got array"},
	} {
		var v types.NewSandboxV2
		err := decode(httptest.NewRequest("POST", "/v2/sandboxes", strings.NewReader(c.body)), &v, false)
		if !errors.Is(err, errBadRequest) {
			t.Errorf("%s: %v, want a bad request", c.body, err)
			continue
		}
		if msg := err.Error(); !strings.Contains(msg, c.want) || strings.Contains(msg, "Go ") || strings.Contains(msg, "NewSandbox") || strings.Contains(msg, "float64") {
			t.Errorf("%s: %q, want %q and no Go names", c.body, msg, c.want)
		}
	}
}
