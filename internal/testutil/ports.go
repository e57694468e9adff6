package testutil

import (
	"testing"

	"github.com/cagehq/cage/internal/freeport"
)

// FreeAddr is freeport.Addr: ip:PORT for a port nothing listens on and
// that this process never handed out (each test package runs in a
// network namespace of its own, so what it handed out is what might still
// be taken).
func FreeAddr(ip string) (string, error) { return freeport.Addr(ip) }

// FreeLoopback is FreeAddr on 127.0.0.1, failing t on error.
func FreeLoopback(t testing.TB) string {
	t.Helper()
	addr, err := FreeAddr("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	return addr
}
