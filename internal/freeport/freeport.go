// Package freeport picks TCP ports for programs that cannot report the
// port they got for :0 (a daemon started by a test or by `cage bench`).
package freeport

import (
	"net"
	"sync"
)

var (
	mu    sync.Mutex
	given = map[string]bool{}
)

// Addr is ip:PORT for a TCP port nothing listens on now and that this
// process has not handed out before. The kernel picks the port of a listen
// on :0 at random among the free ones, so two picks in a row can get the
// same port once the first's listener is closed: a daemon given it as API
// and proxy address failed with "address already in use" (CI, test/cli).
// The listeners of a pick stay open until it is made, so none of them is
// picked again by it.
func Addr(ip string) (string, error) {
	mu.Lock()
	defer mu.Unlock()
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
		held = append(held, l)
		if addr := l.Addr().String(); !given[addr] {
			given[addr] = true
			return addr, nil
		}
	}
}
