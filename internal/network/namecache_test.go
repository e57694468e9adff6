package network

import (
	"fmt"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil"
)

// Attack: a key holder sets one sandbox's policy again and again (a key
// may make 1,000 requests a second), each time in internet mode with
// maxRules new denied names. The host resolves each exact denied name
// and caches the answer; a name stayed cached two hours after it was
// last asked for, whether or not any policy still denied it, so the
// daemon remembered thousands more names a second. Expected: the cache
// holds at most maxCachedNames names, and once namesGrace has passed,
// only the names a live sandbox's policy denies.
func TestDeniedNameCacheBounded(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	s := attach(t, h, Policy{Mode: Internet})
	const changes = maxCachedNames/maxRules + 6
	var p Policy
	start := time.Now()
	for i := range changes {
		p = Policy{Mode: Internet}
		for j := range maxRules {
			p.Deny = append(p.Deny, Rule{Name: fmt.Sprintf("n%d-%d.example.org", i, j)})
		}
		if err := s.net.SetPolicy(p); err != nil {
			t.Fatal(err)
		}
	}
	cached := func() int {
		h.names.mu.Lock()
		defer h.names.mu.Unlock()
		return len(h.names.entries)
	}
	n := cached()
	t.Logf("%d policy changes of %d new denied names each in %v: the cache holds %d names", changes, maxRules, time.Since(start).Round(time.Millisecond), n)
	if n > maxCachedNames {
		t.Errorf("the cache of denied names holds %d names; want at most %d", n, maxCachedNames)
	}
	live := map[string]bool{}
	for _, name := range p.exactDenyNames() {
		live[name] = true
	}
	h.pruneNames(time.Now().Add(namesGrace+time.Second), live)
	if n := cached(); n > len(live) {
		t.Errorf("once the grace has passed, the cache holds %d names; want the live policy's %d at most", n, len(live))
	}
}
