// Package units parses and prints the sizes and durations of cage's flags.
package units

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

var suffixes = []struct {
	s string
	n int64
}{
	{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
	{"Ki", 1 << 10}, {"Mi", 1 << 20}, {"Gi", 1 << 30}, {"Ti", 1 << 40},
	{"KB", 1 << 10}, {"MB", 1 << 20}, {"GB", 1 << 30}, {"TB", 1 << 40},
	{"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"T", 1 << 40},
	{"k", 1 << 10}, {"m", 1 << 20}, {"g", 1 << 30}, {"t", 1 << 40},
	{"B", 1}, {"b", 1},
}

// ParseSize reads a byte size: "512", "64K", "512M", "1G", "1.5GiB".
// Units are binary (K = 1024).
func ParseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	mult := int64(1)
	for _, suf := range suffixes {
		if strings.HasSuffix(t, suf.s) {
			t, mult = strings.TrimSuffix(t, suf.s), suf.n
			break
		}
	}
	f, err := strconv.ParseFloat(strings.TrimSpace(t), 64)
	if err != nil || f < 0 || f != f || math.IsInf(f, 0) {
		return 0, fmt.Errorf("%q is not a size (examples: 512M, 1G, 64K)", s)
	}
	v := f * float64(mult)
	if v > 1<<62 {
		return 0, fmt.Errorf("%q is too large", s)
	}
	return int64(v), nil
}

// FormatSize prints a size in the largest binary unit that keeps it whole-ish.
func FormatSize(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%dGiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// HumanSize is n bytes rounded for people: "812 B", "3.8 MiB".
func HumanSize(n int64) string {
	f, unit := float64(n), "B"
	for _, u := range []string{"KiB", "MiB", "GiB", "TiB"} {
		if f < 1024 {
			break
		}
		f, unit = f/1024, u
	}
	if unit == "B" {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.1f %s", f, unit)
}

// ParseDuration reads a duration: Go syntax ("90s", "5m", "1h30m") or a bare
// number of seconds ("300").
func ParseDuration(s string) (time.Duration, error) {
	if n, err := strconv.ParseFloat(strings.TrimSpace(s), 64); err == nil {
		if n < 0 {
			return 0, fmt.Errorf("%q is negative", s)
		}
		if n != n || n >= float64(math.MaxInt64/time.Second) {
			return 0, fmt.Errorf("%q is too long", s)
		}
		return time.Duration(n * float64(time.Second)), nil
	}
	d, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil || d < 0 {
		return 0, fmt.Errorf("%q is not a duration (examples: 30s, 5m, 300)", s)
	}
	return d, nil
}
