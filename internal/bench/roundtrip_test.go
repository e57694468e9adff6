package bench

import (
	"os/exec"
	"strings"
	"testing"
)

// The round trip's peer times a real run, and a run that fails is no
// sample: a failed peer must fail the row, not count as a fast one.
func TestBareTrue(t *testing.T) {
	for _, c := range []struct {
		bin  string
		fail string
	}{{"true", ""}, {"false", "ended"}} {
		path, err := exec.LookPath(c.bin)
		if err != nil {
			t.Fatal(err)
		}
		d, err := bareTrue(path)
		if c.fail == "" {
			if err != nil || d <= 0 {
				t.Fatalf("%s: %v, %v; want a positive duration", c.bin, d, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), c.fail) {
			t.Fatalf("%s: %v, %v; want an error naming %q", c.bin, d, err, c.fail)
		}
	}
	if _, err := bareTrue("/nonexistent/true"); err == nil {
		t.Fatal("a missing binary gave a sample")
	}
}
