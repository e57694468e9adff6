package network

import (
	"fmt"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/cagehq/cage/internal/testutil"
)

// learnedInTable counts the elements of the learned sets (names,
// namesp), whatever generation they belong to.
func learnedInTable(t *testing.T, h *Host) int {
	t.Helper()
	h.nft.mu.Lock()
	defer h.nft.mu.Unlock()
	total := 0
	for _, set := range []string{setNames, setNamesP} {
		els, err := h.nft.conn.GetSetElements(h.nft.sets[set])
		if err != nil {
			t.Fatal(err)
		}
		total += len(els)
	}
	return total
}

// Attack: a tenant allows a wildcard of its own domain, whose servers
// answer each name with maxAnswerAddrs addresses; code in the sandbox
// learns as many as the sandbox may hold (maxSandboxElems), and the tenant
// then sets the sandbox's policy again and again through the API (1,000
// requests a second are a key's default). Each change writes the learned
// addresses under the new generation's id; those of the old one stayed in
// the shared sets until their TTL (an hour here), so each change added
// maxSandboxElems elements that GC would have to list and sweep under the
// lock every tenant's rule change takes. Expected: after 20 changes the
// sets hold the sandbox's maxSandboxElems elements, no more, for names
// without and with ports; after the sandbox's close, none.
func TestPolicyChangesLeaveNoLearned(t *testing.T) {
	testutil.NewWorld(t)
	h, err := NewHost(Config{Upstreams: []string{hugeAnswers(t, maxAnswerAddrs)}, LockDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	gw := h.Gateway().String() + ":53"
	for _, c := range []struct {
		name   string
		policy Policy
		per    int // elements an address takes
	}{
		{"names", mustPolicy(t, Allowlist, "*.attacker.test"), 1},
		{"ports", mustPolicy(t, Allowlist, "*.attacker.test:80", "*.attacker.test:443"), 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := attach(t, h, c.policy)
			err := testutil.InNS(s.ns, func() error {
				cl := &dns.Client{Net: "tcp", Timeout: 5 * time.Second}
				for i := range maxSandboxElems / (maxAnswerAddrs * c.per) {
					q := new(dns.Msg).SetQuestion(fmt.Sprintf("%s%d.attacker.test.", c.name, i), dns.TypeA)
					if m, _, err := cl.Exchange(q, gw); err != nil || m.Rcode != dns.RcodeSuccess {
						return fmt.Errorf("question %d: %v %v", i, m, err)
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if n := learnedInTable(t, h); n != maxSandboxElems {
				t.Fatalf("the learned sets hold %d elements after the answers; want %d", n, maxSandboxElems)
			}
			start := time.Now()
			for range 20 {
				if err := s.net.SetPolicy(c.policy); err != nil {
					t.Fatal(err)
				}
			}
			n := learnedInTable(t, h)
			t.Logf("the learned sets hold %d elements after 20 policy changes in %v", n, time.Since(start).Round(time.Millisecond))
			if n != maxSandboxElems {
				t.Errorf("the learned sets hold %d elements after 20 policy changes; want the sandbox's %d", n, maxSandboxElems)
			}
			// The addresses stay open through the changes (a name still allowed).
			if els, err := h.nft.elements(s.net.Slot, map[int]string{1: "n", 2: "p"}[c.per]); err != nil || len(els) != maxSandboxElems {
				t.Errorf("the sandbox's current generation holds %d learned elements (%v); want %d", len(els), err, maxSandboxElems)
			}
			if err := s.net.Close(); err != nil {
				t.Fatal(err)
			}
			if n := learnedInTable(t, h); n != 0 {
				t.Errorf("the learned sets hold %d elements after the sandbox's close; want none", n)
			}
		})
	}
}
