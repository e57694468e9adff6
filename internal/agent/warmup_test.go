package agent

import (
	"bytes"
	"testing"
)

// TestWarmUp: the agent's own request goes the whole way through its
// HTTP/2 server, Connect and Start (WarmUp checks that the answer is the
// end of a stream saying not_found), with or without a token configured,
// and leaves no process behind.
func TestWarmUp(t *testing.T) {
	for _, token := range []string{"", fsTestToken} {
		s, _ := newAuthServer(t, func(c *Config) { c.Token = token })
		if err := s.WarmUp(); err != nil {
			t.Fatalf("token %q: %v", token, err)
		}
		s.procs.mu.Lock()
		n := len(s.procs.table)
		s.procs.mu.Unlock()
		if n != 0 {
			t.Fatalf("token %q: %d processes left after the warm-up", token, n)
		}
	}
}

// TestWarmAnswerRefusesOthers: an answer other than not_found (a refused
// token, say) is an error, not a warm-up that silently did nothing.
func TestWarmAnswerRefusesOthers(t *testing.T) {
	env := func(flags byte, body string) []byte {
		n := len(body)
		return append([]byte{flags, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}, body...)
	}
	for name, tc := range map[string]struct {
		data []byte
		ok   bool
	}{
		"not_found":        {env(2, `{"error":{"code":"not_found","message":"x"}}`), true},
		"unauthenticated":  {env(2, `{"error":{"code":"unauthenticated"}}`), false},
		"no error":         {env(2, `{}`), false},
		"no end":           {env(0, "\x08\x01"), false},
		"truncated":        {env(2, `{"error":{"code":"not_found"}}`)[:10], false},
		"message then end": {bytes.Join([][]byte{env(0, "\x08\x01"), env(2, `{"error":{"code":"not_found"}}`)}, nil), true},
	} {
		if err := warmAnswer(tc.data); (err == nil) != tc.ok {
			t.Errorf("%s: warmAnswer = %v, want ok=%v", name, err, tc.ok)
		}
	}
}
