package network

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"

	"github.com/cagehq/cage/internal/testutil"
)

// holdQueue holds the table's lock until want jobs are queued, so that they
// are committed in one group; it fails the test if they never are.
func holdQueue(t testing.TB, n *nft, want int) (release func()) {
	t.Helper()
	n.mu.Lock()
	return func() {
		defer n.mu.Unlock()
		deadline := time.Now().Add(20 * time.Second)
		for {
			n.qmu.Lock()
			got := len(n.queue)
			n.qmu.Unlock()
			if got >= want {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("%d jobs queued, want %d", got, want)
				return
			}
			time.Sleep(time.Millisecond)
		}
	}
}

// TestGroupCommitKeepsEachPolicy: sandboxes attached at once, their rules
// committed in one group, each keep their own policy: the internet ones
// reach the outside, the ones with an empty allowlist do not, and after a group
// of policy changes (each the other way round) the opposite holds.
func TestGroupCommitKeepsEachPolicy(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	const n = 8
	nss := namespaces(t, n)
	policy := func(i int, flip bool) Policy {
		if (i%2 == 0) != flip {
			return Policy{Mode: Internet}
		}
		return Policy{Mode: Allowlist} // nothing allowed
	}
	base := nextSlot + 1
	nextSlot += n
	sbs := make([]*fakeSandbox, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	release := holdQueue(t, h.nft, n)
	for i := range nss {
		wg.Go(func() {
			sb, err := h.Attach(fmt.Sprintf("sb%d", base+i), base+i, int(nss[i]), policy(i, false))
			sbs[i], errs[i] = &fakeSandbox{ns: nss[i], net: sb}, err
		})
	}
	release()
	wg.Wait()
	for i, sb := range sbs {
		if errs[i] != nil {
			t.Fatalf("attach %d: %v", i, errs[i])
		}
		t.Cleanup(func() { _ = sb.net.Close() })
	}
	check := func(flip bool) {
		t.Helper()
		for i, sb := range sbs {
			_, err := sb.get(testutil.PublicHost.String() + ":80")
			if open := policy(i, flip).Mode == Internet; open != (err == nil) {
				t.Errorf("sandbox %d (%v): reached the outside: %v (%v)", i, policy(i, flip).Mode, err == nil, err)
			}
		}
	}
	check(false)
	h.nft.mu.Lock()
	groups := h.nft.groups
	h.nft.mu.Unlock()
	if groups == 0 {
		t.Fatal("the attaches were not committed in a group")
	}
	release = holdQueue(t, h.nft, n)
	for i, sb := range sbs {
		wg.Go(func() { errs[i] = sb.net.SetPolicy(policy(i, true)) })
	}
	release()
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	h.nft.mu.Lock()
	if h.nft.groups == groups {
		t.Error("the policy changes were not committed in a group")
	}
	h.nft.mu.Unlock()
	check(true)
}

// TestGroupCommitFailureIsItsOwn: in a group where one job's batch is
// refused by the kernel (a rule in a chain that does not exist), that job
// fails and the others are committed all the same.
func TestGroupCommitFailureIsItsOwn(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	n := h.nft
	const jobs = 5
	name := func(i int) string { return "gtest" + strconv.Itoa(i) }
	var wg sync.WaitGroup
	errs := make([]error, jobs)
	release := holdQueue(t, n, jobs)
	for i := range jobs {
		j := &nftJob{slot: 900000 + i, done: make(chan error, 1), build: func(c *nftables.Conn) error {
			ch := &nftables.Chain{Name: name(i), Table: n.table}
			if i == 2 {
				ch = &nftables.Chain{Name: "gtest-missing", Table: n.table}
			} else {
				c.AddChain(ch)
			}
			c.AddRule(&nftables.Rule{Table: n.table, Chain: ch, Exprs: []expr.Any{&expr.Counter{}}})
			return nil
		}}
		wg.Go(func() {
			n.enqueue(j)
			errs[i] = <-j.done
		})
	}
	release()
	wg.Wait()
	t.Cleanup(func() {
		for i := range jobs {
			n.conn.DelChain(&nftables.Chain{Name: name(i), Table: n.table})
			_ = n.conn.Flush()
		}
	})
	chains, err := n.conn.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, ch := range chains {
		if ch.Table.Name == tableName {
			have[ch.Name] = true
		}
	}
	for i := range jobs {
		if i == 2 {
			if errs[i] == nil || have[name(i)] {
				t.Errorf("the refused job: error %v, chain made %v; want an error and no chain", errs[i], have[name(i)])
			}
			continue
		}
		if errs[i] != nil || !have[name(i)] {
			t.Errorf("job %d: error %v, chain made %v; want its chain", i, errs[i], have[name(i)])
		}
	}
}

// TestRemoveHalfMade: removing a slot of which only some elements exist (a
// half-made sandbox, or one whose owner died: this process knows nothing
// of it) removes its entry and is no error; what its id still had in the
// shared sets is swept.
func TestRemoveHalfMade(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	n := h.nft
	nextSlot++
	slot := nextSlot
	id, err := newID(1, 1)
	if err != nil {
		t.Fatal(err)
	}
	n.mu.Lock()
	err = errors.Join(
		n.conn.SetAddElements(n.sets[setSbx], []nftables.SetElement{{Key: sbxKey(ifName(slot), h.IP(slot)), Val: id[:]}}),
		n.conn.SetAddElements(n.sets[setNames], []nftables.SetElement{{Key: idAddr(id, testutil.PublicHost)}}))
	if err == nil {
		err = n.conn.Flush()
	}
	n.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	if err := n.remove(slot); err != nil {
		t.Fatalf("remove: %v", err)
	}
	slots, err := n.slots()
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(slots, slot) {
		t.Fatalf("slot %d's entry is still there", slot)
	}
	if swept := n.sweep(); swept < 1 {
		t.Errorf("swept %d elements, want the dead id's", swept)
	}
	n.mu.Lock()
	els, err := n.conn.GetSetElements(n.sets[setNames])
	n.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range els {
		if sbxID(e.Key[:16]) == id {
			t.Fatal("the dead id's element is still there after the sweep")
		}
	}
}

// BenchmarkApplyManyAlive: a sandbox's rules made and removed (as a create
// and a destroy do), eight at once, with 0, 300 and 1,000 sandboxes' rules
// in the table; the applies committed in groups and (the peer, as before)
// each alone. The cost per create should not grow with the sandboxes
// alive. Run as root: go test -run ^$ -bench ApplyManyAlive ./internal/network
func BenchmarkApplyManyAlive(b *testing.B) {
	w := testutil.NewWorld(b)
	h, err := NewHost(Config{Upstreams: w.Upstreams(), LockDir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(h.Close)
	rules := func(slot int) *sandboxRules {
		ip := netip.AddrFrom4([4]byte{10, 250, byte(slot >> 8), byte(slot)})
		return &sandboxRules{slot: slot, ip: ip, gateway: h.gateway, policy: Policy{Mode: Internet},
			denied: h.denied, resolver: h.res.port, group: h.flog.group}
	}
	const first = 700000
	alive := 0
	next := first + 100000
	b.Cleanup(func() {
		for s := first; s < first+alive; s++ {
			_ = h.nft.remove(s)
		}
	})
	for _, want := range []int{0, 300, 1000} {
		for ; alive < want; alive++ {
			if _, err := h.nft.apply(rules(first+alive), setState{}); err != nil {
				b.Fatal(err)
			}
		}
		for _, mode := range []struct {
			name    string
			noGroup bool
		}{{"group", false}, {"alone", true}} {
			b.Run(fmt.Sprintf("alive=%d/%s", want, mode.name), func(b *testing.B) {
				h.nft.noGroup = mode.noGroup
				var mu sync.Mutex
				b.SetParallelism(8)
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						mu.Lock()
						s := next
						next++
						mu.Unlock()
						if _, err := h.nft.apply(rules(s), setState{}); err != nil {
							b.Error(err)
							return
						}
						if err := h.nft.remove(s); err != nil {
							b.Error(err)
							return
						}
					}
				})
			})
		}
	}
}

// TestManyElementsInOneBatch: thousands of elements added and deleted in
// one batch (a policy change of a sandbox holding thousands of learned or
// denied addresses; a sweep) all arrive. A set message's element list is
// one netlink attribute with a 16-bit length: one list of 2,000 elements
// with timeouts wrapped, and the kernel added 510 of them while the batch
// reported success (a policy change could so drop denied addresses).
func TestManyElementsInOneBatch(t *testing.T) {
	w := testutil.NewWorld(t)
	n := newHost(t, w, nil).nft
	for _, c := range []struct {
		set     string
		timeout time.Duration
	}{{setNames, time.Hour}, {setDNames, 0}, {setNamesP, time.Hour}} {
		id, err := newID(1, 1)
		if err != nil {
			t.Fatal(err)
		}
		var els []elem
		for i := range 6000 {
			a := netip.AddrFrom4([4]byte(binary.BigEndian.AppendUint32(nil, 0x0b000000+uint32(i))))
			key := idAddr(id, a)
			if c.set == setNamesP {
				key = append(key, 0, 80, 0, 0)
			}
			els = append(els, elem{c.set, nftables.SetElement{Key: key, Timeout: c.timeout}})
		}
		count := func() int {
			list, err := n.conn.GetSetElements(n.sets[c.set])
			if err != nil {
				t.Fatal(err)
			}
			return len(slices.DeleteFunc(list, func(e nftables.SetElement) bool { return sbxID(e.Key[:16]) != id }))
		}
		n.mu.Lock()
		err = n.addElems(n.conn, els)
		if err == nil {
			err = n.conn.Flush()
		}
		if got := count(); err != nil || got != len(els) {
			t.Errorf("set %s: %d elements added in one batch: %d there (%v)", c.set, len(els), got, err)
		}
		err = n.delElems(n.conn, els)
		if err == nil {
			err = n.conn.Flush()
		}
		if got := count(); err != nil || got != 0 {
			t.Errorf("set %s: %d elements deleted in one batch: %d left (%v)", c.set, len(els), got, err)
		}
		n.mu.Unlock()
	}
}
