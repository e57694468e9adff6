package network

import (
	"errors"
	"strings"
	"testing"

	"github.com/miekg/dns"
)

// FuzzParseRule: any string either is refused with ErrPolicy or is a rule
// that reads back as itself: a lower-case name of plain labels (with at
// most a leading "*."), or a masked IPv4 range; its port is 1-65535 or 0.
func FuzzParseRule(f *testing.F) {
	for _, s := range []string{"example.com", "*.example.com:443", "93.184.216.34", "10.1.2.3/16:5432", "Example.COM.",
		"", "::1", "[::1]:80", "a..b", "a.*.com", "host:0", "host:99999", "1.2.3.4/33", "300.1.1.1", "*", "0.0.0.0/0",
		"evil\\.com", "a\x00b.com", " pypi.org ", "xn--bcher-kva.example", "1.2.3.4:80:90", "01.2.3.4", "*.*.a"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseRule(s)
		if err != nil {
			if !errors.Is(err, ErrPolicy) {
				t.Fatalf("ParseRule(%q): %v is not ErrPolicy", s, err)
			}
			return
		}
		if r.Name != "" {
			if r.Prefix.IsValid() {
				t.Fatalf("ParseRule(%q): both a name and a range", s)
			}
			if _, ok := hostName(strings.TrimPrefix(r.Name, "*.")); !ok {
				t.Fatalf("ParseRule(%q) = name %q, not a plain host name", s, r.Name)
			}
			if strings.Contains(strings.TrimPrefix(r.Name, "*."), "*") {
				t.Fatalf("ParseRule(%q) = name %q with an inner wildcard", s, r.Name)
			}
		} else if !r.Prefix.Addr().Is4() || r.Prefix != r.Prefix.Masked() {
			t.Fatalf("ParseRule(%q) = range %v, not a masked IPv4 prefix", s, r.Prefix)
		}
		again, err := ParseRule(r.String())
		if err != nil || again != r {
			t.Fatalf("ParseRule(%q) = %q, which reads back as %+v, %v", s, r, again, err)
		}
	})
}

// wireLabels reads the labels of the uncompressed name at off of a packed
// message: the bytes that go on the wire, not their presentation.
func wireLabels(t *testing.T, msg []byte, off int) []string {
	var labels []string
	for {
		if off >= len(msg) {
			t.Fatalf("name runs past the message")
		}
		n := int(msg[off])
		if n == 0 {
			return labels
		}
		if n&0xc0 != 0 || off+1+n > len(msg) {
			t.Fatalf("a compressed or truncated question name")
		}
		labels = append(labels, string(msg[off+1:off+1+n]))
		off += 1 + n
	}
}

// FuzzResolverName: whatever name a sandbox puts in its question (escaped
// dots, \000, any byte), the name the resolver matches against the policy
// is exactly the name it sends upstream, label for label, and is the name
// the sandbox asked for; a name matched under *.allowed.org is, on the
// wire, under allowed.org.
func FuzzResolverName(f *testing.F) {
	for _, s := range []string{"evil\\.com.allowed.org.", "x.allowed.org.", "allowed.org\\000.evil.com.", "\\000.allowed.org.",
		"ALLOWED.org", "a..b.", ".", "*.allowed.org.", "x.allowed.org\\.", "x.y\\.allowed.org.", "\\065llowed.org.",
		"x.allowed.org\\032.", "metadata.google.internal.", strings.Repeat("a.", 130)} {
		f.Add(s)
	}
	p := Policy{Mode: Allowlist, Allow: []Rule{{Name: "*.allowed.org"}, {Name: "allowed.org", Port: 443}}}
	f.Fuzz(func(t *testing.T, qname string) {
		// The question as it reaches the resolver: packed by the sandbox,
		// read back from the wire.
		sent := new(dns.Msg).SetQuestion(dns.Fqdn(qname), dns.TypeA)
		wire, err := sent.Pack()
		if err != nil {
			return // not a name a sandbox can send
		}
		var in dns.Msg
		if err := in.Unpack(wire); err != nil || len(in.Question) != 1 {
			return
		}
		asked := wireLabels(t, wire, 12)
		name, ok := hostName(in.Question[0].Name)
		if !ok {
			return
		}
		up, err := upstreamQuestion(&in, name).Pack()
		if err != nil {
			t.Fatalf("the upstream question for %q does not pack: %v", name, err)
		}
		upstream := wireLabels(t, up, 12)
		if strings.Join(upstream, ".") != name || len(upstream) != strings.Count(name, ".")+1 {
			t.Fatalf("matched %q, asked upstream %q", name, upstream)
		}
		for i, l := range asked {
			if i >= len(upstream) || strings.ToLower(l) != upstream[i] {
				t.Fatalf("the sandbox asked %q, upstream was asked %q", asked, upstream)
			}
		}
		if len(asked) != len(upstream) {
			t.Fatalf("the sandbox asked %q, upstream was asked %q", asked, upstream)
		}
		if ok, _ := p.NamePorts(name); ok {
			n := len(upstream)
			if n < 2 || upstream[n-2] != "allowed" || upstream[n-1] != "org" {
				t.Fatalf("%q was allowed under allowed.org but goes upstream as %q", qname, upstream)
			}
		}
	})
}
