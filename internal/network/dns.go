package network

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"
)

// The resolver answers the sandboxes of this process: the nat chain of each
// redirects DNS sent to the gateway to it, and it listens on the gateway
// address only (never on the host's other interfaces). A name the sandbox's
// policy does not allow gets NXDOMAIN without any query leaving the host,
// so DNS cannot carry data out; an allowed name is asked of the upstream
// resolvers, and the addresses in the answer are allowed for the sandbox
// for their TTL (they are what a name in an allowlist opens). In internet
// mode a name the policy denies is asked upstream too, and its addresses
// are denied, before the sandbox gets its NXDOMAIN. AAAA questions get an
// empty answer: sandboxes are IPv4 only.
//
// The name matched against the policy is the name asked upstream: a
// question whose name is not a plain host name (an escaped dot or any byte
// but letters, digits, '-' and '_' in a label) is refused before matching,
// and the upstream question is built from the matched name.
type resolver struct {
	h         *Host
	port      uint16
	udp, tcp  *dns.Server
	upstreams []string
	client    *dns.Client
}

// Learned addresses stay allowed for their TTL, bounded so that a zero TTL
// still lets the connection that follows the lookup start, and a day-long
// one does not outlive a changed record by much.
const (
	minLearnTTL = 30 * time.Second
	maxLearnTTL = time.Hour
)

// Each sandbox may ask this many questions a second (with this burst);
// beyond, it gets REFUSED without anything asked upstream.
const (
	queryRate  = 100
	queryBurst = 300
)

func clampTTL(ttl time.Duration) time.Duration { return min(max(ttl, minLearnTTL), maxLearnTTL) }

func startResolver(h *Host, upstreams []string) (*resolver, error) {
	r := &resolver{h: h, upstreams: upstreams, client: &dns.Client{Timeout: 3 * time.Second}}
	// UDP and TCP on one port of the gateway address, any free one: each
	// cage process has its own. The address exists only on the host ends of
	// sandboxes' veths, so the sockets are bound before it does (freebind).
	lc := net.ListenConfig{Control: func(network, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_FREEBIND, 1)
			if serr == nil && network == "udp4" {
				// Each datagram says the interface it came in on.
				serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_PKTINFO, 1)
			}
		})
		return errors.Join(err, serr)
	}}
	ctx := context.Background()
	var pc net.PacketConn
	var l net.Listener
	var err error
	for range 20 {
		if pc, err = lc.ListenPacket(ctx, "udp4", netip.AddrPortFrom(h.gateway, 0).String()); err != nil {
			return nil, fmt.Errorf("resolver: %w", err)
		}
		port := pc.LocalAddr().(*net.UDPAddr).Port
		if l, err = lc.Listen(ctx, "tcp4", netip.AddrPortFrom(h.gateway, uint16(port)).String()); err == nil {
			r.port = uint16(port)
			break
		}
		pc.Close()
	}
	if err != nil {
		return nil, fmt.Errorf("resolver: %w", err)
	}
	r.udp = &dns.Server{PacketConn: senderPackets{pc.(*net.UDPConn), h}, Handler: r, UDPSize: 4096}
	r.tcp = &dns.Server{Listener: senderListener{l, h}, Handler: r, ReadTimeout: 5 * time.Second, IdleTimeout: func() time.Duration { return 10 * time.Second },
		DecorateReader: func(rd dns.Reader) dns.Reader { return boundedReader{rd} }}
	for _, s := range []*dns.Server{r.udp, r.tcp} {
		started := make(chan struct{})
		s.NotifyStartedFunc = func() { close(started) }
		go func() { _ = s.ActivateAndServe() }()
		<-started
	}
	return r, nil
}

func (r *resolver) close() {
	_ = r.udp.Shutdown()
	_ = r.tcp.Shutdown()
}

// The resolver's sockets name the sandbox a question came from when it
// came, never when it is served: a question still queued when its sandbox
// closed and another took the slot's address (a TCP connection's
// pipelined questions wait for each answer from upstream, seconds each)
// is never taken as the new holder's, in its records, rate or sets.
// A datagram is the sandbox's whose address and interface it came from
// (IP_PKTINFO; see Host.sender); a TCP connection is the sandbox's whose
// address it came from when accepted, and ends with it.

// senderAddr is a question's source address with the sandbox that sent it
// (nil: none of this process's).
type senderAddr struct {
	net.Addr
	sb *Sandbox
}

// senderPackets is the resolver's UDP socket, naming each datagram's
// sandbox as it is read.
type senderPackets struct {
	*net.UDPConn
	h *Host
}

func (c senderPackets) ReadFrom(b []byte) (int, net.Addr, error) {
	oob := make([]byte, unix.CmsgSpace(unix.SizeofInet4Pktinfo))
	n, oobn, _, from, err := c.ReadMsgUDPAddrPort(b, oob)
	if err != nil {
		return n, nil, err
	}
	link := 0
	if cms, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
		for _, cm := range cms {
			if cm.Header.Level == unix.SOL_IP && cm.Header.Type == unix.IP_PKTINFO && len(cm.Data) >= unix.SizeofInet4Pktinfo {
				link = int(int32(binary.NativeEndian.Uint32(cm.Data)))
			}
		}
	}
	return n, senderAddr{net.UDPAddrFromAddrPort(from), c.h.sender(from.Addr().Unmap(), link)}, nil
}

func (c senderPackets) WriteTo(b []byte, to net.Addr) (int, error) {
	if a, ok := to.(senderAddr); ok {
		to = a.Addr
	}
	return c.UDPConn.WriteTo(b, to)
}

// senderListener is the resolver's TCP socket, naming each connection's
// sandbox as it is accepted.
type senderListener struct {
	net.Listener
	h *Host
}

func (l senderListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		var sb *Sandbox
		if a, err := netip.ParseAddrPort(c.RemoteAddr().String()); err == nil {
			sb = l.h.bySource(a.Addr().Unmap())
		}
		if sb != nil && sb.tcpConns.Add(1) > maxTCPConns {
			sb.tcpConns.Add(-1)
			c.Close()
			continue
		}
		return &senderConn{Conn: c, from: senderAddr{c.RemoteAddr(), sb}}, nil
	}
}

// maxTCPConns bounds the TCP connections one sandbox has open to the
// resolver at once; one past it is closed as it is accepted. A stub
// resolver keeps one or two. Found by review, 2026-12-05: each is a
// descriptor, a goroutine and socket buffers of the daemon's, charged to
// no sandbox, and a question every 10 s (the idle timeout) keeps one
// open: 64 of 64 were served at once, and within a sandbox's DNS packet
// rate (200 a second) some 2,000 could be kept (estimated, not run), up
// to its bound of tracked connections, 4,096.
const maxTCPConns = 32

// maxTCPQuestion bounds a question over TCP, as the UDP socket's buffer
// (the server's UDPSize) bounds one over UDP: a question is one name and
// its EDNS options, a few hundred bytes.
const maxTCPQuestion = 4096

// errQuestionSize ends a TCP connection whose next message is longer than
// maxTCPQuestion.
var errQuestionSize = fmt.Errorf("a question longer than %d bytes", maxTCPQuestion)

// boundedReader reads a TCP connection's messages as the server's own
// reader does, but refuses, before anything is held for it, one whose
// length prefix is past maxTCPQuestion: the server's reader took each
// prefix at its word and held a buffer of that size (up to 64 KiB) until
// the rest came or its read timed out (5 s, 10 s after a first question).
// Found by review, 2026-12-05: one sandbox's connections that each sent
// a prefix of 65,535 and one byte held 26 MiB of the daemon's heap,
// charged to no sandbox, within the sandbox's DNS packet rate.
type boundedReader struct{ dns.Reader }

func (r boundedReader) ReadTCP(conn net.Conn, timeout time.Duration) ([]byte, error) {
	return r.Reader.ReadTCP(&prefixCheck{Conn: conn}, timeout)
}

// prefixCheck is a connection read for one message: the server's reader
// reads its 2-byte length prefix first, which this checks as it comes.
type prefixCheck struct {
	net.Conn
	prefix []byte
}

func (c *prefixCheck) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if k := min(n, 2-len(c.prefix)); k > 0 {
		c.prefix = append(c.prefix, b[:k]...)
		if len(c.prefix) == 2 && binary.BigEndian.Uint16(c.prefix) > maxTCPQuestion {
			return 0, errQuestionSize
		}
	}
	return n, err
}

type senderConn struct {
	net.Conn
	from   senderAddr
	closed sync.Once
}

func (c *senderConn) RemoteAddr() net.Addr { return c.from }

// Close closes the connection and gives its sandbox's count back, once.
func (c *senderConn) Close() error {
	err := c.Conn.Close()
	c.closed.Do(func() {
		if c.from.sb != nil {
			c.from.sb.tcpConns.Add(-1)
		}
	})
	return err
}

// ServeDNS answers one query from a sandbox.
func (r *resolver) ServeDNS(w dns.ResponseWriter, q *dns.Msg) {
	from, ok := w.RemoteAddr().(senderAddr)
	if !ok || from.sb == nil || from.sb.gone() {
		if ok && w.RemoteAddr().Network() == "tcp" {
			_ = w.Close() // a connection of no live sandbox reads no more
		}
		return // not one of this process's live sandboxes: no answer at all
	}
	sb := from.sb
	reply := func(m *dns.Msg) {
		size := dns.MinMsgSize
		if opt := q.IsEdns0(); opt != nil {
			size = int(opt.UDPSize())
		}
		if w.RemoteAddr().Network() == "udp" {
			m.Truncate(size)
		}
		_ = w.WriteMsg(m)
	}
	if q.Opcode != dns.OpcodeQuery || len(q.Question) != 1 || q.Question[0].Qclass != dns.ClassINET {
		reply(new(dns.Msg).SetRcode(q, dns.RcodeRefused))
		return
	}
	question := q.Question[0]
	qtype := dns.TypeToString[question.Qtype]
	rec := Record{Sandbox: sb.ID, Kind: "dns", QType: qtype}
	if !sb.queries.allow(time.Now(), queryRate, queryBurst) {
		rec.Name, rec.Decision, rec.Detail = strings.ToLower(question.Name), "deny", "rate limited"
		r.h.record(rec)
		reply(new(dns.Msg).SetRcode(q, dns.RcodeRefused))
		return
	}
	name, ok := hostName(question.Name)
	rec.Name = name
	if !ok {
		rec.Name, rec.Decision, rec.Detail = question.Name, "deny", "not a host name"
		r.h.record(rec)
		reply(new(dns.Msg).SetRcode(q, dns.RcodeNameError))
		return
	}
	policy, gen := sb.snapshot()
	if policy.deniesName(name) {
		if sb.asking.take(maxAsking) {
			r.denied(sb, gen, q, name, rec)
			sb.asking.give()
		} else {
			rec.Decision, rec.Detail = "deny", errAsking.Error()
			r.h.record(rec)
		}
		reply(new(dns.Msg).SetRcode(q, dns.RcodeNameError))
		return
	}
	if ok, _ := policy.NamePorts(name); !ok {
		rec.Decision = "deny"
		r.h.record(rec)
		reply(new(dns.Msg).SetRcode(q, dns.RcodeNameError))
		return
	}
	if question.Qtype == dns.TypeAAAA {
		m := new(dns.Msg).SetReply(q)
		m.RecursionAvailable = true
		rec.Decision, rec.Detail = "allow", "no IPv6 in sandboxes"
		r.h.record(rec)
		reply(m)
		return
	}
	if !sb.asking.take(maxAsking) {
		rec.Decision, rec.Detail = "allow", errAsking.Error()
		r.h.record(rec)
		reply(new(dns.Msg).SetRcode(q, dns.RcodeServerFailure))
		return
	}
	defer sb.asking.give()
	reply(r.allowed(sb, gen, q, name, rec))
}

// maxAsking bounds the questions of one sandbox on their way upstream at
// once; past it, an allowed name gets SERVFAIL (the sandbox asks again)
// and a denied one its NXDOMAIN without its addresses being asked. Each
// is a goroutine, a socket and a buffer of the daemon's, charged to no
// sandbox, for up to 4 s per upstream while the upstream is slow (a
// tenant's own name servers): found by review, 2026-12-05, 200 of 200
// questions of one sandbox were on their way at once, and at the
// question rate (100 a second) some 400 per upstream would be.
const maxAsking = 64

// errAsking says a question was not asked upstream: maxAsking of the
// sandbox's were on their way.
var errAsking = fmt.Errorf("not asked upstream: %d questions of the sandbox's are on their way", maxAsking)

// gauge counts what is in progress.
type gauge struct{ n atomic.Int32 }

// take counts one more if fewer than limit are in progress.
func (g *gauge) take(limit int32) bool {
	if g.n.Add(1) > limit {
		g.n.Add(-1)
		return false
	}
	return true
}

func (g *gauge) give() { g.n.Add(-1) }

// allowed asks the upstream resolvers for an allowed name and lets the
// sandbox reach the answer's addresses, unless its policy changed since the
// question came (then it gets SERVFAIL, and asks again under the new one).
func (r *resolver) allowed(sb *Sandbox, gen uint64, q *dns.Msg, name string, rec Record) *dns.Msg {
	rec.Decision = "allow"
	ans, err := r.ask(context.Background(), upstreamQuestion(q, name))
	if err != nil {
		r.h.log.Debug("resolver: upstream", "name", name, "err", err)
		rec.Detail = "upstream failed: " + err.Error()
		r.h.record(rec)
		return new(dns.Msg).SetRcode(q, dns.RcodeServerFailure)
	}
	addrs, ttl := answerAddrs(ans)
	if err := sb.commit(gen, name, addrs, ttl); err != nil {
		if !errors.Is(err, errStale) && !errors.Is(err, errGone) && !errors.Is(err, errFull) {
			r.h.log.Warn("resolver: allow the answer's addresses", "sandbox", sb.ID, "err", err)
		}
		rec.Detail = "not answered: " + err.Error()
		r.h.record(rec)
		return new(dns.Msg).SetRcode(q, dns.RcodeServerFailure)
	}
	rec.Detail = joinAddrs(addrs)
	r.h.record(rec)
	keepAddrs(ans, addrs)
	ans.Id = q.Id
	ans.Question = q.Question // as the sandbox spelt it
	return ans
}

// denied asks the upstream resolvers for a name an internet-mode policy
// denies and denies the sandbox the addresses of the answer (the sandbox
// itself gets NXDOMAIN whatever the answer).
func (r *resolver) denied(sb *Sandbox, gen uint64, q *dns.Msg, name string, rec Record) {
	rec.Decision = "deny"
	if q.Question[0].Qtype == dns.TypeA {
		if ans, err := r.ask(context.Background(), upstreamQuestion(q, name)); err == nil {
			addrs, ttl := answerAddrs(ans)
			err := sb.commit(gen, name, addrs, ttl)
			if err != nil && !errors.Is(err, errStale) && !errors.Is(err, errGone) && !errors.Is(err, errFull) {
				r.h.log.Warn("resolver: deny the answer's addresses", "sandbox", sb.ID, "err", err)
			}
			rec.Detail = "denied addresses: " + joinAddrs(addrs)
			if errors.Is(err, errFull) {
				rec.Detail = "denied (its addresses not added: " + err.Error() + "): " + joinAddrs(addrs)
			}
		}
	}
	r.h.record(rec)
}

// hostName is the name of a question as matched and asked upstream: lower
// case, without the final dot, each label letters, digits, '-' or '_'. A
// name in any other form (escapes such as "\." inside a label or "\000",
// other bytes, empty labels, the root) is not one (ok false).
func hostName(qname string) (string, bool) {
	name := strings.TrimSuffix(strings.ToLower(qname), ".")
	if name == "" || len(name) > 253 {
		return "", false
	}
	for _, label := range strings.Split(name, ".") {
		if len(label) == 0 || len(label) > 63 {
			return "", false
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return "", false
			}
		}
	}
	return name, true
}

// upstreamQuestion is q asked for name (the name the policy matched) with
// a fresh id; EDNS options are kept, nothing else of q's header.
func upstreamQuestion(q *dns.Msg, name string) *dns.Msg {
	out := new(dns.Msg)
	out.SetQuestion(name+".", q.Question[0].Qtype)
	out.RecursionDesired = true
	out.CheckingDisabled = q.CheckingDisabled
	if opt := q.IsEdns0(); opt != nil {
		out.SetEdns0(min(opt.UDPSize(), upstreamUDPSize), opt.Do())
	}
	return out
}

// upstreamUDPSize is the most a question asked upstream claims of EDNS's
// buffer size (DNS Flag Day 2020's), whatever the sandbox's claims: the
// resolver's client reserves a receive buffer of the claimed size for
// each question on its way, and a sandbox may claim 65,535 bytes. An
// answer larger comes over TCP, as any truncated one does.
const upstreamUDPSize = 1232

// maxAnswerAddrs bounds the addresses taken from one answer (the sandbox
// gets those alone): a name's servers may answer with thousands, which the
// host would otherwise put in the shared sets, one element each.
const maxAnswerAddrs = 32

// answerAddrs are the IPv4 addresses of an answer, at most maxAnswerAddrs
// of them (the first, each once), and their TTL (the shortest), clamped.
func answerAddrs(ans *dns.Msg) ([]netip.Addr, time.Duration) {
	var addrs []netip.Addr
	ttl := maxLearnTTL
	for _, rr := range ans.Answer {
		if a, ok := rr.(*dns.A); ok && len(addrs) < maxAnswerAddrs {
			if ip, ok := netip.AddrFromSlice(a.A.To4()); ok && !slices.Contains(addrs, ip) {
				addrs = append(addrs, ip)
				ttl = min(ttl, time.Duration(a.Hdr.Ttl)*time.Second)
			}
		}
	}
	return addrs, clampTTL(ttl)
}

// keepAddrs leaves in ans's answer only the A records of addrs (other
// records, CNAMEs among them, stay).
func keepAddrs(ans *dns.Msg, addrs []netip.Addr) {
	ans.Answer = slices.DeleteFunc(ans.Answer, func(rr dns.RR) bool {
		a, ok := rr.(*dns.A)
		if !ok {
			return false
		}
		ip, ok := netip.AddrFromSlice(a.A.To4())
		return !ok || !slices.Contains(addrs, ip)
	})
}

func joinAddrs(addrs []netip.Addr) string {
	s := make([]string, 0, len(addrs))
	for _, a := range addrs {
		s = append(s, a.String())
	}
	return strings.Join(s, " ")
}

// ask sends q to the upstream resolvers in turn (over TCP when the UDP
// answer is truncated), each for at most 4 s and all within ctx.
func (r *resolver) ask(ctx context.Context, q *dns.Msg) (*dns.Msg, error) {
	if len(r.upstreams) == 0 {
		return nil, fmt.Errorf("no upstream resolver (none in /etc/resolv.conf, and none configured)")
	}
	var last error
	for _, up := range r.upstreams {
		actx, cancel := context.WithTimeout(ctx, 4*time.Second)
		ans, _, err := r.client.ExchangeContext(actx, q, up)
		if err == nil && ans.Truncated {
			tcp := &dns.Client{Net: "tcp", Timeout: 3 * time.Second}
			ans, _, err = tcp.ExchangeContext(actx, q, up)
		}
		cancel()
		if err == nil {
			return ans, nil
		}
		last = err
		if ctx.Err() != nil {
			break
		}
	}
	return nil, last
}

// ParseUpstreams reads resolver addresses, "ip" or "ip:port" (empty
// entries are skipped).
func ParseUpstreams(list []string) ([]string, error) {
	var out []string
	for _, s := range list {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		if ap, err := netip.ParseAddrPort(s); err == nil {
			out = append(out, ap.String())
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, fmt.Errorf("resolver %q: want an IP address, optionally with :port", s)
		}
		out = append(out, netip.AddrPortFrom(a, 53).String())
	}
	return out, nil
}

// HostResolvers reads the nameservers of a resolv.conf as host:port.
func HostResolvers(path string) []string {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "nameserver" {
			if a, err := netip.ParseAddr(fields[1]); err == nil {
				out = append(out, netip.AddrPortFrom(a.WithZone(""), 53).String())
			}
		}
	}
	return out
}
