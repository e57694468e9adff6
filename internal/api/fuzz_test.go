package api

import (
	"bytes"
	"errors"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/sandbox"
)

// FuzzCreateBody: whatever JSON a client sends to create a sandbox, the
// API either refuses it as a bad request (decode, createRequest) or hands
// the manager a request whose numbers are sane: a positive timeout that did
// not wrap, no negative limit, and a network policy that validates. A
// request then either validates as sandbox options or is refused as
// invalid — never a panic.
func FuzzCreateBody(f *testing.F) {
	for _, seed := range []string{
		`{"templateID":"base"}`,
		`{"templateID":"host","timeout":18446744074,"memoryMB":1125899906842624}`,
		`{"templateID":"host","timeout":-1}`,
		`{"templateID":"x","cpuCount":1e308,"pids":9223372036854775807}`,
		`{"templateID":"x","cpuCount":-1000}`,
		`{"templateID":"x","network":{"allowOut":["0.0.0.0/0","a.b:443"],"denyOut":["10.0.0.0/8"]}}`,
		`{"templateID":"x","network":{"mode":"allowlist","allowOut":["*.github.com"]},"allow_internet_access":false}`,
		`{"templateID":"x","envVars":{"A=B":"c","":"d"},"metadata":{"k":"v"}}`,
		`{"templateID":"x","network":{"rules":{}}}`,
		`{"templateID":"x","wall":"microvm","diskSizeMB":0}`,
		`[]`, `{"templateID":`, `null`,
	} {
		f.Add([]byte(seed), true)
	}
	s := &server{cfg: Config{DefaultWall: "process", V1Timeout: 15 * time.Second, V2Timeout: 300 * time.Second}}
	f.Fuzz(func(t *testing.T, data []byte, v2 bool) {
		r := httptest.NewRequest("POST", "/v2/sandboxes", bytes.NewReader(data))
		var body types.NewSandbox
		if err := decode(r, &body, false); err != nil {
			if !errors.Is(err, errBadRequest) {
				t.Fatalf("decode error of the wrong kind: %v", err)
			}
			return
		}
		req, err := s.createRequest(body, v2)
		if err != nil {
			if !errors.Is(err, errBadRequest) {
				t.Fatalf("createRequest error of the wrong kind: %v", err)
			}
			return
		}
		if req.Timeout <= 0 {
			t.Fatalf("timeout %v from %s", req.Timeout, data)
		}
		if body.Timeout != nil && *body.Timeout > 0 && *body.Timeout < 1<<31 && req.Timeout != time.Duration(*body.Timeout)*time.Second {
			t.Fatalf("timeout %d s became %v", *body.Timeout, req.Timeout)
		}
		if req.Memory < 0 || req.Disk < 0 || req.Pids < 0 || !(req.CPUs >= 0) {
			t.Fatalf("negative limit passed: %+v", req)
		}
		if body.MemoryMB<<20 != req.Memory || body.DiskSizeMB<<20 != req.Disk {
			t.Fatalf("memoryMB %d and diskSizeMB %d became %d and %d bytes", body.MemoryMB, body.DiskSizeMB, req.Memory, req.Disk)
		}
		if err := req.Net.Validate(); err != nil {
			t.Fatalf("policy that does not validate passed: %v (%s)", err, data)
		}
		o := sandbox.Options{Wall: req.Wall, Template: req.Template, Memory: req.Memory, Disk: req.Disk, CPUs: req.CPUs, Pids: req.Pids, Env: req.Env, Net: req.Net}
		if err := o.Validate(); err != nil && !errors.Is(err, sandbox.ErrInvalid) {
			t.Fatalf("options error of the wrong kind: %v", err)
		} else if err == nil {
			m := sandbox.HostMaxima()
			if o.Memory > m.Memory || o.CPUs > m.CPUs || o.Pids > m.Pids || o.Disk > m.Disk {
				t.Fatalf("options above the host's maxima validated: %+v", o)
			}
		}
	})
}
