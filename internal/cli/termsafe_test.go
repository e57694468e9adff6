package cli

import "testing"

func TestTermSafe(t *testing.T) {
	for _, c := range []struct{ in, cell, lines string }{
		{"plain text, ünïcode ✓", "plain text, ünïcode ✓", "plain text, ünïcode ✓"},
		{"a\x1b]52;c;eA==\x07b", `a\x1b]52;c;eA==\x07b`, `a\x1b]52;c;eA==\x07b`},
		{"row\r\nFAKE\tx", `row\x0d\x0aFAKE\x09x`, "row\\x0d\nFAKE\tx"},
		{"c1 \u009b2J del \x7f", `c1 \u009b2J del \x7f`, `c1 \u009b2J del \x7f`},
		{"bidi \u202eevil\u2066", `bidi \u202eevil\u2066`, `bidi \u202eevil\u2066`},
		{"bad \xff\xc3 utf8 \ufffd", `bad \xff\xc3 utf8 ` + "\ufffd", `bad \xff\xc3 utf8 ` + "\ufffd"},
	} {
		if got := termSafe(c.in); got != c.cell {
			t.Errorf("termSafe(%q) = %q, want %q", c.in, got, c.cell)
		}
		if got := termSafeLines(c.in); got != c.lines {
			t.Errorf("termSafeLines(%q) = %q, want %q", c.in, got, c.lines)
		}
	}
}
