package network

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/cagehq/cage/internal/testutil"
)

// TestConcurrentAttach: eight sandboxes attached at once (as a daemon's
// creates do) each get their pair whole: the host end with IPv6 off and
// no IPv6 address, the gateway on it; eth0 inside with the sandbox's
// address and IPv6 off; and each reaches the outside.
func TestConcurrentAttach(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	const n = 8
	nss := namespaces(t, n)
	base := nextSlot + 1
	nextSlot += n
	sbs := make([]*Sandbox, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range nss {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sbs[i], errs[i] = h.Attach(fmt.Sprintf("sb%d", base+i), base+i, int(nss[i]), Policy{Mode: Internet})
		}()
	}
	wg.Wait()
	for i, sb := range sbs {
		if errs[i] != nil {
			t.Fatalf("attach %d: %v", i, errs[i])
		}
		t.Cleanup(func() { _ = sb.Close() })
	}
	for i, sb := range sbs {
		name := ifName(sb.Slot)
		v6, err := os.ReadFile("/proc/sys/net/ipv6/conf/" + name + "/disable_ipv6")
		if err == nil && strings.TrimSpace(string(v6)) != "1" {
			t.Errorf("%s: disable_ipv6 %q, want 1", name, v6)
		}
		for _, knob := range []string{"arp_ignore", "arp_filter"} {
			v, err := os.ReadFile("/proc/sys/net/ipv4/conf/" + name + "/" + knob)
			if err != nil || strings.TrimSpace(string(v)) != "1" {
				t.Errorf("%s: %s %q (%v), want 1", name, knob, v, err)
			}
		}
		link, err := netlink.LinkByName(name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if a6, _ := netlink.AddrList(link, netlink.FAMILY_V6); len(a6) > 0 {
			t.Errorf("%s has IPv6 addresses %v", name, a6)
		}
		a4, _ := netlink.AddrList(link, netlink.FAMILY_V4)
		if len(a4) != 1 || !a4[0].IP.Equal(h.gateway.AsSlice()) {
			t.Errorf("%s: addresses %v, want the gateway %s", name, a4, h.gateway)
		}
		inside, err := netlink.NewHandleAt(nss[i])
		if err != nil {
			t.Fatal(err)
		}
		eth0, err := inside.LinkByName("eth0")
		if err != nil {
			inside.Close()
			t.Fatalf("sandbox %d: eth0: %v", i, err)
		}
		in4, _ := inside.AddrList(eth0, netlink.FAMILY_V4)
		in6, _ := inside.AddrList(eth0, netlink.FAMILY_V6)
		inside.Close()
		if len(in6) > 0 {
			t.Errorf("sandbox %d: eth0 has IPv6 addresses %v", i, in6)
		}
		var off []byte
		if err := onThreadIn(int(nss[i]), func() (err error) {
			off, err = os.ReadFile("/proc/sys/net/ipv6/conf/eth0/disable_ipv6")
			return err
		}); err == nil && strings.TrimSpace(string(off)) != "1" {
			t.Errorf("sandbox %d: eth0's disable_ipv6 %q, want 1", i, off)
		}
		if len(in4) != 1 || !in4[0].IP.Equal(sb.IP.AsSlice()) {
			t.Errorf("sandbox %d: eth0 addresses %v, want %s", i, in4, sb.IP)
		}
		s := &fakeSandbox{ns: nss[i], net: sb}
		if body, err := s.get(testutil.PublicHost.String() + ":80"); err != nil || body == "" {
			t.Errorf("sandbox %d cannot reach the outside: %q %v", i, body, err)
		}
	}
}

// namespaces makes n bare network namespaces for a test's "sandboxes".
func namespaces(t *testing.T, n int) []netns.NsHandle {
	t.Helper()
	nss := make([]netns.NsHandle, n)
	for i := range nss {
		nss[i], _ = namespace(t)
	}
	return nss
}

// namespace is a network namespace the test holds (pinned at a path, and
// by a handle) until its end, or until gone lets go of both.
func namespace(t testing.TB) (ns netns.NsHandle, gone func()) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "netns")
	if err := NewNamespace(path); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { RemoveNamespace(path) })
	ns, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Close() })
	return ns, func() { ns.Close(); RemoveNamespace(path) }
}
