package units

import (
	"testing"
	"time"
)

func TestParseSize(t *testing.T) {
	good := map[string]int64{"512": 512, "64K": 64 << 10, "512M": 512 << 20, "1G": 1 << 30,
		"1.5GiB": 3 << 29, "2Mi": 2 << 20, "100b": 100, " 8M ": 8 << 20}
	for in, want := range good {
		got, err := ParseSize(in)
		if err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "abc", "-1M", "1X", "M", "NaN", "Inf", "+Inf", "1e30G"} {
		if got, err := ParseSize(in); err == nil {
			t.Errorf("ParseSize(%q) = %d, want an error", in, got)
		}
	}
}

func TestFormatSize(t *testing.T) {
	for n, want := range map[int64]string{1 << 30: "1GiB", 512 << 20: "512MiB", 4096: "4KiB", 1000: "1000B"} {
		if got := FormatSize(n); got != want {
			t.Errorf("FormatSize(%d) = %q, want %q", n, got, want)
		}
	}
}

func TestParseDuration(t *testing.T) {
	good := map[string]time.Duration{"300": 300 * time.Second, "1.5": 1500 * time.Millisecond, "5m": 5 * time.Minute, "1h30m": 90 * time.Minute}
	for in, want := range good {
		got, err := ParseDuration(in)
		if err != nil || got != want {
			t.Errorf("ParseDuration(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	// Too long to be a time.Duration: refused, never wrapped into a short one
	// (18446744074 s times 1e9 wraps to 0.29 s in int64).
	for _, in := range []string{"", "-5", "-1s", "soon", "NaN", "Inf", "18446744074", "1e300"} {
		if _, err := ParseDuration(in); err == nil {
			t.Errorf("ParseDuration(%q): want an error", in)
		}
	}
}
