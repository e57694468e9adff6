package network

import (
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// A sandbox's end forgets its address's tracked connections before its
// slot can be another's (forgetFlows). Each way of finding them costs a
// walk of the kernel's whole connection hash table (all its buckets,
// 262,144 on a host with this memory, whatever few entries it holds): the
// kernel's filtered dumps take four walks an address (the address at
// either end of either direction), a dump of every entry to this process
// takes one walk and the decoding of each entry here. Ends come in bursts
// (a key's sandboxes killed, a team's timeout, a daemon's stop): the ends
// waiting at once are one batch, forgotten by one walk where that costs
// less than their filtered dumps. Measured (BenchmarkForgetFlows, a test
// suite running beside it): a filtered end 23 ms, a whole walk with
// 20,000 entries 119 ms, about 6 ms a bucket walk and 5.6 µs an entry
// decoded, so a walk is worth it while the entries number fewer than
// (4 × batch − 1) × buckets / 256.

// flowReaper gathers the addresses whose connections are to be forgotten
// and forgets them a batch at a time, one batch in progress.
type flowReaper struct {
	mu      sync.Mutex
	pending map[netip.Addr][]chan error
	running bool
}

var reaper flowReaper

// forget forgets ip's connections with the batch it joins and returns
// once they are gone.
func (r *flowReaper) forget(ip netip.Addr) error {
	done := make(chan error, 1)
	r.mu.Lock()
	if r.pending == nil {
		r.pending = map[netip.Addr][]chan error{}
	}
	r.pending[ip] = append(r.pending[ip], done)
	if !r.running {
		r.running = true
		go r.run()
	}
	r.mu.Unlock()
	return <-done
}

func (r *flowReaper) run() {
	for {
		r.mu.Lock()
		batch := r.pending
		r.pending = nil
		if len(batch) == 0 {
			r.running = false
			r.mu.Unlock()
			return
		}
		r.mu.Unlock()
		addrs := make([]netip.Addr, 0, len(batch))
		for ip := range batch {
			addrs = append(addrs, ip)
		}
		errs := forgetBatch(addrs, walkCheaper(len(addrs), conntrackCount(), conntrackBuckets()))
		for ip, waiters := range batch {
			for _, w := range waiters {
				w <- errs[ip]
			}
		}
	}
}

// walkCheaper says whether one walk of every entry (entries of them, in
// a table of buckets) costs less than batch addresses' filtered dumps
// (see above). An unknown count or size (-1) keeps the filtered dumps.
func walkCheaper(batch, entries, buckets int) bool {
	if entries < 0 || buckets <= 0 {
		return false
	}
	return entries*256 < (4*batch-1)*buckets
}

// forgetBatch forgets the connections of addrs, by one walk of the table
// (walk) or each address's filtered dumps, and says how it went for each
// address (nil: forgotten). A walk that fails twice leaves it to the
// filtered dumps.
func forgetBatch(addrs []netip.Addr, walk bool) map[netip.Addr]error {
	errs := make(map[netip.Addr]error, len(addrs))
	if walk {
		set := addrSet{}
		for _, ip := range addrs {
			set[ip] = true
		}
		_, err := netlink.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, set)
		if err != nil {
			_, err = netlink.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, set)
		}
		if err == nil {
			for _, ip := range addrs {
				errs[ip] = nil
			}
			return errs
		}
	}
	for _, ip := range addrs {
		errs[ip] = forgetOne(ip)
	}
	return errs
}

// addrSet matches a flow with any of its addresses at either end, either
// way.
type addrSet map[netip.Addr]bool

func (s addrSet) MatchConntrackFlow(flow *netlink.ConntrackFlow) bool {
	for _, b := range [][]byte{flow.Forward.SrcIP, flow.Forward.DstIP, flow.Reverse.SrcIP, flow.Reverse.DstIP} {
		if a, ok := netip.AddrFromSlice(b); ok && s[a.Unmap()] {
			return true
		}
	}
	return false
}

// netfilterDir is this process's /proc/sys/net/netfilter, opened once (a
// path from /proc/sys/net walks one entry per network namespace that has
// looked there: see procsys).
var netfilterDir = sync.OnceValue(func() *os.File {
	f, err := os.Open("/proc/sys/net/netfilter")
	if err != nil {
		return nil
	}
	return f
})

// conntrackCount is the number of entries of this network namespace's
// connection table (-1: unknown).
func conntrackCount() int { return readNetfilterInt("nf_conntrack_count") }

// conntrackBuckets is the size of the kernel's connection hash table,
// every namespace's (-1: unknown).
func conntrackBuckets() int { return readNetfilterInt("nf_conntrack_buckets") }

func readNetfilterInt(name string) int {
	dir := netfilterDir()
	if dir == nil {
		return -1
	}
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return -1
	}
	defer unix.Close(fd)
	b := make([]byte, 32)
	n, err := unix.Read(fd, b)
	if err != nil || n <= 0 {
		return -1
	}
	v, err := strconv.Atoi(strings.TrimSpace(string(b[:n])))
	if err != nil {
		return -1
	}
	return v
}

// errForget names the address whose connections could not be forgotten.
func errForget(ip netip.Addr, err error) error {
	return fmt.Errorf("forget the connections of %s: %w", ip, err)
}
