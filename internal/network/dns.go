package network

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/miekg/dns"
)

// The resolver answers the sandboxes of this process: the nat chain of each
// redirects DNS sent to the gateway to it. A name the sandbox's policy does
// not allow gets NXDOMAIN without any query leaving the host, so DNS cannot
// carry data out; an allowed name is asked of the upstream resolvers, and
// the addresses in the answer are allowed for the sandbox for their TTL
// (they are what a name in an allowlist opens). AAAA questions get an empty
// answer: sandboxes are IPv4 only.
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

func startResolver(h *Host, upstreams []string) (*resolver, error) {
	r := &resolver{h: h, upstreams: upstreams, client: &dns.Client{Timeout: 3 * time.Second}}
	// UDP and TCP on one port, any free one: each cage process has its own.
	var pc net.PacketConn
	var l net.Listener
	var err error
	for range 20 {
		if pc, err = net.ListenPacket("udp4", "0.0.0.0:0"); err != nil {
			return nil, fmt.Errorf("resolver: %w", err)
		}
		port := pc.LocalAddr().(*net.UDPAddr).Port
		if l, err = net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", port)); err == nil {
			r.port = uint16(port)
			break
		}
		pc.Close()
	}
	if err != nil {
		return nil, fmt.Errorf("resolver: %w", err)
	}
	r.udp = &dns.Server{PacketConn: pc, Handler: r, UDPSize: 4096}
	r.tcp = &dns.Server{Listener: l, Handler: r, ReadTimeout: 5 * time.Second, IdleTimeout: func() time.Duration { return 10 * time.Second }}
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

// ServeDNS answers one query from a sandbox.
func (r *resolver) ServeDNS(w dns.ResponseWriter, q *dns.Msg) {
	src, err := netip.ParseAddrPort(w.RemoteAddr().String())
	if err != nil {
		return
	}
	sb := r.h.bySource(src.Addr().Unmap())
	if sb == nil {
		return // not one of this process's sandboxes: no answer at all
	}
	reply := func(m *dns.Msg) {
		size := dns.MinMsgSize
		if opt := q.IsEdns0(); opt != nil {
			size = int(opt.UDPSize())
		}
		if _, udp := w.RemoteAddr().(*net.UDPAddr); udp {
			m.Truncate(size)
		}
		_ = w.WriteMsg(m)
	}
	if q.Opcode != dns.OpcodeQuery || len(q.Question) != 1 || q.Question[0].Qclass != dns.ClassINET {
		reply(new(dns.Msg).SetRcode(q, dns.RcodeRefused))
		return
	}
	question := q.Question[0]
	name := strings.TrimSuffix(strings.ToLower(question.Name), ".")
	policy := sb.Policy()
	ok, ports := policy.NamePorts(name)
	qtype := dns.TypeToString[question.Qtype]
	if !ok {
		r.h.record(Record{Sandbox: sb.ID, Kind: "dns", Name: name, QType: qtype, Decision: "deny"})
		reply(new(dns.Msg).SetRcode(q, dns.RcodeNameError))
		return
	}
	if question.Qtype == dns.TypeAAAA {
		m := new(dns.Msg).SetReply(q)
		m.RecursionAvailable = true
		r.h.record(Record{Sandbox: sb.ID, Kind: "dns", Name: name, QType: qtype, Decision: "allow", Detail: "no IPv6 in sandboxes"})
		reply(m)
		return
	}
	ans, err := r.ask(q)
	if err != nil {
		r.h.log.Debug("resolver: upstream", "name", name, "err", err)
		r.h.record(Record{Sandbox: sb.ID, Kind: "dns", Name: name, QType: qtype, Decision: "allow", Detail: "upstream failed: " + err.Error()})
		reply(new(dns.Msg).SetRcode(q, dns.RcodeServerFailure))
		return
	}
	ans.Id = q.Id
	var addrs []netip.Addr
	ttl := maxLearnTTL
	for _, rr := range ans.Answer {
		if a, ok := rr.(*dns.A); ok {
			if ip, ok := netip.AddrFromSlice(a.A.To4()); ok {
				addrs = append(addrs, ip)
				ttl = min(ttl, time.Duration(a.Hdr.Ttl)*time.Second)
			}
		}
	}
	// In internet mode only names that an allow entry names need their
	// addresses learned (they may be inside a denied range).
	learn := policy.Mode == Allowlist || policy.Mode == Internet && explicitlyAllowed(policy, name)
	if learn && len(addrs) > 0 {
		if err := sb.learn(name, addrs, ports, max(ttl, minLearnTTL)); err != nil {
			r.h.log.Warn("resolver: allow the answer's addresses", "sandbox", sb.ID, "err", err)
			reply(new(dns.Msg).SetRcode(q, dns.RcodeServerFailure))
			return
		}
	}
	detail := make([]string, 0, len(addrs))
	for _, a := range addrs {
		detail = append(detail, a.String())
	}
	r.h.record(Record{Sandbox: sb.ID, Kind: "dns", Name: name, QType: qtype, Decision: "allow", Detail: strings.Join(detail, " ")})
	reply(ans)
}

func explicitlyAllowed(p Policy, name string) bool {
	for _, r := range p.Allow {
		if r.matches(name) {
			return true
		}
	}
	return false
}

// ask forwards q to the upstream resolvers in turn (over TCP when the UDP
// answer is truncated).
func (r *resolver) ask(q *dns.Msg) (*dns.Msg, error) {
	if len(r.upstreams) == 0 {
		return nil, fmt.Errorf("no upstream resolver (none in /etc/resolv.conf, and none configured)")
	}
	out := q.Copy()
	out.Id = dns.Id()
	var last error
	for _, up := range r.upstreams {
		ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
		ans, _, err := r.client.ExchangeContext(ctx, out, up)
		if err == nil && ans.Truncated {
			tcp := &dns.Client{Net: "tcp", Timeout: 3 * time.Second}
			ans, _, err = tcp.ExchangeContext(ctx, out, up)
		}
		cancel()
		if err == nil {
			return ans, nil
		}
		last = err
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
