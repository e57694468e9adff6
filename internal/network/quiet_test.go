package network

import (
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// A sandbox's end skips the walk of the host's connection table only when
// its interface never carried a packet. Attack: a sandbox sends one
// datagram out and ends (the least that leaves a tracked connection), or,
// adopted (its namespace not held), its namespace goes before its Close
// (its end of the pair with it, and the count of what it sent). Expected:
// both are forgotten by a walk, and none of their connections is left
// tracked; a sandbox that sent nothing ends without one, its processes
// gone before its Close as at a kill.
func TestQuietEndWalksNothing(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	// The sandbox's processes are gone before its Close (a kill): the
	// hold Attach took keeps its end of the pair for Close to read.
	ns, gone := namespace(t)
	nextSlot++
	quiet, err := h.Attach("quiet", nextSlot, int(ns), Policy{Mode: Internet})
	if err != nil {
		t.Fatal(err)
	}
	gone()
	time.Sleep(100 * time.Millisecond) // time for a namespace nobody held to go
	before := quietEnds.Load()
	if err := quiet.Close(); err != nil {
		t.Fatal(err)
	}
	if got := quietEnds.Load() - before; got != 1 {
		t.Errorf("a sandbox that sent nothing: %d quiet ends, want 1", got)
	}

	for _, nsGone := range []bool{false, true} {
		name := map[bool]string{false: "one datagram", true: "one datagram, adopted, namespace gone first"}[nsGone]
		t.Run(name, func(t *testing.T) {
			port := 7300
			if nsGone {
				port++
			}
			udpEcho(t, w, port)
			ns, gone := namespace(t)
			nextSlot++
			sb, err := h.Attach("busy", nextSlot, int(ns), Policy{Mode: Internet})
			if err != nil {
				t.Fatal(err)
			}
			s := &fakeSandbox{ns: ns, net: sb}
			var r string
			for range 5 { // a fresh interface may lose the first datagram
				if r, err = s.exchange(41000+port, port, "one"); err == nil {
					break
				}
			}
			if err != nil || r != "echo one" {
				t.Fatalf("the exchange: %q, %v", r, err)
			}
			if n := trackedFrom(t, sb.IP, netip.Addr{}); n == 0 {
				t.Fatal("control: the exchange left nothing tracked")
			}
			if nsGone {
				// An adopted sandbox's namespace is not held: once its
				// last process is gone, the kernel destroys it and the
				// pair with it, and what the sandbox sent is not known.
				unix.Close(sb.ns)
				sb.ns = -1
				gone()
				deadline := time.Now().Add(20 * time.Second)
				for {
					if _, err := netlink.LinkByName(ifName(sb.Slot)); err != nil {
						break
					}
					if time.Now().After(deadline) {
						t.Fatal("the namespace's pair is still on the host 20 s after its last hold went")
					}
					time.Sleep(10 * time.Millisecond)
				}
			}
			before := quietEnds.Load()
			if err := sb.Close(); err != nil {
				t.Fatal(err)
			}
			if quietEnds.Load() != before {
				t.Error("a sandbox that sent a datagram ended without forgetting its connections")
			}
			if n := trackedFrom(t, sb.IP, netip.Addr{}); n != 0 {
				t.Errorf("%d of its connections still tracked after its end", n)
			}
		})
	}
}

// BenchmarkQuietEnd: a sandbox's Close when its interface carried nothing
// (no walk of the table) against the same Close followed by the walk that
// every end made before (the peer, same run); per end, the Attach not
// timed, the namespace's other holds gone before the Close as at a kill:
// the time (mostly the kernel taking the namespace and the pair) and this
// process's CPU (user and system: the walk is the kernel's work in the
// calling thread).
func BenchmarkQuietEnd(b *testing.B) {
	w := testutil.NewWorld(b)
	h, err := NewHost(Config{Upstreams: w.Upstreams(), LockDir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(h.Close)
	nextSlot++
	slot := nextSlot
	run := func(b *testing.B, walk bool) {
		var cpu time.Duration
		for b.Loop() {
			b.StopTimer()
			ns, gone := namespace(b)
			sb, err := h.Attach("bench", slot, int(ns), Policy{Mode: Internet})
			gone()
			if err != nil {
				b.Fatal(err)
			}
			c0 := cpuTime(b)
			b.StartTimer()
			if err := sb.Close(); err != nil {
				b.Fatal(err)
			}
			if walk {
				if err := forgetFlows(sb.IP); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			cpu += cpuTime(b) - c0
			b.StartTimer()
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1e6, "ms/end")
		b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N)/1e6, "cpu-ms/end")
	}
	b.Run("quiet", func(b *testing.B) { run(b, false) })
	b.Run("walked", func(b *testing.B) { run(b, true) })
}

// cpuTime is this process's CPU time so far, user and system.
func cpuTime(b *testing.B) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
