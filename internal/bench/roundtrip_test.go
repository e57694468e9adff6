package bench

import (
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"
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

// A peer's sample is its time to first output, and a peer that printed
// nothing or failed is no sample.
func TestFirstOutput(t *testing.T) {
	d, err := FirstOutput([]string{"sh", "-c", "sleep 0.05; echo ready; sleep 0.05"})
	if err != nil || d < 50*time.Millisecond {
		t.Fatalf("first output after %v, %v; want it after the first sleep", d, err)
	}
	for _, argv := range [][]string{{"true"}, {"sh", "-c", "echo ready; exit 3"}, {"/nonexistent"}} {
		if d, err := FirstOutput(argv); err == nil {
			t.Errorf("%q: a sample of %v; want an error", argv, d)
		}
	}
}

func TestRunRate(t *testing.T) {
	if r, err := RunRate([]string{"true"}, 8, 3); err != nil || r <= 0 {
		t.Fatalf("rate %v, %v", r, err)
	}
	if r, err := RunRate([]string{"false"}, 8, 3); err == nil {
		t.Fatalf("a failing peer gave a rate of %v", r)
	}
}

// Alternate interleaves the two and a failed peer fails it, named.
func TestAlternate(t *testing.T) {
	var order []string
	a, b, err := Alternate(3, 1, func() (time.Duration, error) { order = append(order, "c"); return time.Millisecond, nil },
		func() (time.Duration, error) { order = append(order, "p"); return 2 * time.Millisecond, nil })
	if err != nil || a.N != 3 || b.N != 3 || a.P50 != time.Millisecond || b.P50 != 2*time.Millisecond || strings.Join(order, "") != "cpcpcpcp" {
		t.Fatalf("%v %v %v %v", a, b, err, order)
	}
	_, _, err = Alternate(3, 0, func() (time.Duration, error) { return time.Millisecond, nil },
		func() (time.Duration, error) { return 0, errors.New("boom") })
	if err == nil || !strings.Contains(err.Error(), "the peer: boom") {
		t.Fatalf("err %v", err)
	}
}
