package types_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The committed types.gen.go is what the pinned generator makes of
// api/openapi.yaml now. The generator is run from the module cache only
// (GOPROXY=off): a test reaches no network.
func TestGeneratedTypesCurrent(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command on PATH to run the generator with")
	}
	out := filepath.Join(t.TempDir(), "types.gen.go")
	cmd := exec.Command(goBin, "tool", "oapi-codegen", "-config", "../api/types/oapi-codegen.yaml",
		"-o", out, "../api/openapi.yaml")
	cmd.Dir = "../../tools"
	cmd.Env = append(os.Environ(), "GOPROXY=off", "GOFLAGS=-mod=readonly")
	msg, err := cmd.CombinedOutput()
	if err != nil {
		if strings.Contains(string(msg), "GOPROXY=off") && os.Getenv("CAGE_REQUIRE_TOOLS") != "1" {
			t.Skipf("oapi-codegen is not in the module cache (run `make api` once to fetch it):\n%s", msg)
		}
		t.Fatalf("oapi-codegen: %v\n%s", err, msg)
	}
	want, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile("types.gen.go")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("api/types/types.gen.go is stale: api/openapi.yaml or the generator changed; run `make api` and commit the result")
	}
}
