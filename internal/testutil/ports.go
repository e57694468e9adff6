package testutil

import (
	"net"
	"sync"
	"testing"
)

var (
	portsMu sync.Mutex
	given   = map[string]bool{}
)

// FreeAddr is ip:PORT for a TCP port nothing listens on now and that this
// process has not handed out before, for a program the test starts that
// cannot report the port it got for :0. The kernel picks the port of a
// listen on :0 at random among the free ones, so two picks in a row can
// get the same port once the first's listener is closed: a daemon given it
// as API and proxy address failed with "address already in use" (CI,
// test/cli). Each test package runs in a network namespace of its own,
// so what this process handed out is what might still be taken.
func FreeAddr(ip string) (string, error) {
	portsMu.Lock()
	defer portsMu.Unlock()
	var held []net.Listener
	defer func() {
		for _, l := range held {
			l.Close()
		}
	}()
	for {
		l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
		if err != nil {
			return "", err
		}
		held = append(held, l) // open until the pick: never picked again now
		addr := l.Addr().String()
		if !given[addr] {
			given[addr] = true
			return addr, nil
		}
	}
}

// FreeLoopback is FreeAddr on 127.0.0.1, failing t on error.
func FreeLoopback(t testing.TB) string {
	t.Helper()
	addr, err := FreeAddr("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	return addr
}
