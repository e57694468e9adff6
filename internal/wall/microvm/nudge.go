package microvm

import (
	"sync/atomic"
	"time"

	"github.com/hashicorp/yamux"
)

// The guest's virtio console can miss a wakeup: a reader is not woken for
// data already in its queue, or a writer for buffers the host has given
// back (Linux's virtio_console, seen by others as writes to a port that
// hang until something else happens on the device). Here it looked like a
// request whose answer never came. Every interrupt of the device makes the
// guest look at all of its queues, so any later traffic from the host
// wakes whoever was left waiting. nudge makes that traffic while it can
// matter: a yamux ping every nudgeEvery while the session has a stream
// open. An idle session (a pooled sandbox, one nobody talks to) is left
// alone, and a ping is a few bytes each way.
const (
	nudgeEvery = time.Second
	// nudgesOut bounds the pings waiting for their answer: a guest that
	// is stopped, or slow under TCG, is not sent more than this many.
	nudgesOut = 4
)

// nudge pings the guest's agent every nudgeEvery while sess has a stream
// open, until sess ends. A ping that goes unanswered does not end the
// session (yamux's keepalive would): only traffic matters here.
func nudge(sess *yamux.Session) {
	t := time.NewTicker(nudgeEvery)
	defer t.Stop()
	var out atomic.Int32
	for {
		select {
		case <-sess.CloseChan():
			return
		case <-t.C:
		}
		if sess.NumStreams() == 0 || out.Load() >= nudgesOut {
			continue
		}
		out.Add(1)
		go func() {
			defer out.Add(-1)
			_, _ = sess.Ping()
		}()
	}
}
