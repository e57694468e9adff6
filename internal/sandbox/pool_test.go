package sandbox

import (
	"errors"
	"testing"
)

// TestPoolNames: a pool in configuration is TEMPLATE (the default wall) or
// WALL/TEMPLATE; an unknown wall or no template is ErrInvalid, naming it.
func TestPoolNames(t *testing.T) {
	for _, tc := range []struct{ key, wall, tmpl string }{
		{"base", "", "base"}, {"runc/base", "runc", "base"}, {"microvm/code-interpreter-v1", "microvm", "code-interpreter-v1"},
	} {
		w, tm := PoolOf(tc.key)
		if w != tc.wall || tm != tc.tmpl {
			t.Errorf("PoolOf(%q) = %q, %q; want %q, %q", tc.key, w, tm, tc.wall, tc.tmpl)
		}
		if err := CheckPool(tc.key); err != nil {
			t.Errorf("CheckPool(%q): %v", tc.key, err)
		}
	}
	for _, key := range []string{"nowall/base", "runc/", "/base/x", "gvisor/a/b", ""} {
		if err := CheckPool(key); !errors.Is(err, ErrInvalid) {
			t.Errorf("CheckPool(%q) = %v, want ErrInvalid", key, err)
		}
	}
}
