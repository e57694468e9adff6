package microvm

import (
	"context"
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

// stallAfter is how long a ping may go unanswered before nudge reports
// the guest as stalled: far beyond a TCG guest's slowest answer under load
// (a ping is answered by the agent's session loop, not by a command).
var stallAfter = 10 * time.Second

// reportEvery bounds a session's stall reports however its pings go: a
// guest that answers each ping just after stallAfter made one every few
// seconds, each a QMP session and a log line. (A variable for the tests.)
var reportEvery = 10 * time.Minute

// Bounds of what a stall report logs of the guest's console and of QEMU's
// view of its queues: both are the guest's (or a compromised QEMU's) to
// write.
const (
	maxReportConsole = 256
	maxReportQueues  = 4 << 10
)

// clip keeps the last n bytes of s.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "…" + s[len(s)-n:]
}

// nudge pings the guest's agent every nudgeEvery while sess has a stream
// open, until sess ends. A ping that goes unanswered does not end the
// session (yamux's keepalive would): only traffic matters here. One that
// stays unanswered for stallAfter calls stalled (when not nil) with the
// streams open then, once until a ping is answered again and at most once
// every reportEvery: the report of a hang, taken while it lasts.
func nudge(sess *yamux.Session, stalled func(d time.Duration, streams int)) {
	t := time.NewTicker(nudgeEvery)
	defer t.Stop()
	var out atomic.Int32
	var reported atomic.Bool
	var lastReport atomic.Int64 // UnixNano
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
			answered := make(chan error, 1)
			go func() { _, err := sess.Ping(); answered <- err }()
			select {
			case err := <-answered:
				if err == nil {
					reported.Store(false)
				}
				return
			case <-sess.CloseChan():
				return
			case <-time.After(stallAfter):
			}
			if stalled != nil && reported.CompareAndSwap(false, true) {
				now := time.Now().UnixNano()
				if last := lastReport.Load(); (last == 0 || now-last >= int64(reportEvery)) && lastReport.CompareAndSwap(last, now) {
					stalled(stallAfter, sess.NumStreams())
				}
			}
			if err := <-answered; err == nil {
				reported.Store(false)
			}
		}()
	}
}

// reportStall logs what the host can see of a guest that has not answered
// a ping for d while streams were open: the state of each virtio queue
// (QEMU's), the streams and the console's last line. The guest's
// channel hang (a request whose answer never comes) was never caught in
// the act; this is its record when it comes again.
func (sb *Sandbox) reportStall(d time.Duration, streams int) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	queues, err := sb.v.VirtioQueues(ctx)
	if err != nil {
		queues = "not known: " + err.Error()
	}
	logger(sb.cfg).Warn("microvm: the guest has not answered the host's ping", "sandbox", sb.id, "for", d,
		"streams", streams, "virtio", clip(queues, maxReportQueues), "console", clip(sb.v.ConsoleLastLine(), maxReportConsole))
}
