package proxy

import (
	"errors"
	"fmt"
	"io"
	"testing"
)

// A TLS port's pool key names the server name sent, so a pooled connection
// made for one host is never reused for another; a host that is not a DNS
// name (an IP address, odd bytes a client sent) sends none.
func TestUpstream(t *testing.T) {
	a := Access{HTTPSPorts: []int{8443}}
	for _, c := range []struct {
		port        int
		host        string
		scheme, key string
		wantPort    int
		wantName    string
	}{
		{8443, "8443-abc.cage.localhost:3001", "https", "port-8443.8443-abc.cage.localhost", 8443, "8443-abc.cage.localhost"},
		{8443, "Example.COM.", "https", "port-8443.example.com", 8443, "example.com"},
		{8443, "127.0.0.1:3001", "https", "port-8443", 8443, ""},
		{8443, "[::1]:3001", "https", "port-8443", 8443, ""},
		{8443, "a_b.example", "https", "port-8443", 8443, ""},
		{8443, "-a.example", "https", "port-8443", 8443, ""},
		{8443, "a..example", "https", "port-8443", 8443, ""},
		{8080, "8080-abc.cage.localhost", "http", "port-8080", 0, ""},
	} {
		scheme, key := upstream(a, c.port, c.host)
		if scheme != c.scheme || key != c.key {
			t.Errorf("upstream(%d, %q) = %s, %s; want %s, %s", c.port, c.host, scheme, key, c.scheme, c.key)
			continue
		}
		if scheme != "https" {
			continue
		}
		port, name, err := tlsKey(key + ":443")
		if err != nil || port != c.wantPort || name != c.wantName {
			t.Errorf("tlsKey(%q) = %d, %q, %v; want %d, %q", key, port, name, err, c.wantPort, c.wantName)
		}
	}
	for _, bad := range []string{"port-0:443", "port-65536.x:443", "8443:443", "port-x.y:443", "port-8443"} {
		if _, _, err := tlsKey(bad); err == nil {
			t.Errorf("tlsKey(%q) took a bad key", bad)
		}
	}
}

// The agent's port is never dialled over TLS whatever the pool key says.
func TestDialTLSNeverAgent(t *testing.T) {
	if _, err := dialTLS(nil)(t.Context(), "tcp", fmt.Sprintf("port-%d:443", EnvdPort)); err == nil {
		t.Error("dialTLS dialled the agent's port")
	}
}

// Only the errors of a protocol mismatch get the mismatch's message.
func TestTLSMismatch(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("x: %w", errTLSPort), true},
		{io.EOF, true},
		{errors.New(`malformed HTTP response "\x15\x03\x01\x00\x02\x02"`), true},
		{errors.New("connection refused"), false},
	} {
		if got := tlsMismatch(c.err) != ""; got != c.want {
			t.Errorf("tlsMismatch(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
