package cli

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// Text the CLI prints that others chose (a path anyone sent the proxy, a
// user name or route a tenant sent, a message a sandbox's agent wrote, a
// name an admin key gave) must not drive the operator's terminal: an
// escape sequence could set its title, write its clipboard (OSC 52), make
// a link (OSC 8), move the cursor or erase lines, and a carriage return
// or newline could forge a row of `cage audit`. termSafe writes such text
// with every control escaped; what a command's own output is (`cage exec`,
// `cage run`, a build's log) is passed through as it came, as ssh would.

// termSafe escapes every control character of s (C0, DEL, C1, tabs and
// line ends included), the Unicode bidi controls (which reorder what is
// shown) and bytes that are not UTF-8, as \xNN or \uNNNN: a table cell or
// one line.
func termSafe(s string) string { return escapeControls(s, false) }

// termSafeLines is termSafe that keeps newlines and tabs: a message of
// several lines.
func termSafeLines(s string) string { return escapeControls(s, true) }

func escapeControls(s string, keepLines bool) string {
	clean := true
	for _, r := range s {
		if r == utf8.RuneError || unsafeRune(r, keepLines) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n <= 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r < 0x80 && unsafeRune(r, keepLines):
			fmt.Fprintf(&b, `\x%02x`, r)
		case unsafeRune(r, keepLines):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

func unsafeRune(r rune, keepLines bool) bool {
	switch {
	case keepLines && (r == '\n' || r == '\t'):
		return false
	case r < 0x20, r >= 0x7f && r < 0xa0: // C0, DEL, C1
		return true
	case r >= 0x202a && r <= 0x202e, r >= 0x2066 && r <= 0x2069, r == 0x200e, r == 0x200f, r == 0x061c: // bidi
		return true
	}
	return false
}
