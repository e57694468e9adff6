package network

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Mode is how much of the network a sandbox may reach.
type Mode string

const (
	// None is loopback only: the sandbox has no interface but lo.
	None Mode = "none"
	// Internet is the public internet: everything but the always-denied
	// addresses (and the policy's own deny list).
	Internet Mode = "internet"
	// Allowlist is only the listed names and address ranges.
	Allowlist Mode = "allowlist"
)

// Policy is what a sandbox may reach. The always-denied addresses (cloud
// metadata, the host, other sandboxes, private and special ranges) are
// denied whatever it says.
type Policy struct {
	Mode Mode `json:"mode"`
	// Allow lists names (with "*." wildcards) and address ranges, each
	// optionally with a port. In allowlist mode it is all the sandbox may
	// reach; in internet mode it overrides Deny.
	Allow []Rule `json:"allow,omitempty"`
	// Deny lists what internet mode denies besides the always-denied.
	Deny []Rule `json:"deny,omitempty"`
}

// Rule is one entry of an allow or deny list: a name or an address range,
// with a port or 0 for every port.
type Rule struct {
	Name   string       // "example.com" or "*.example.com"; "" for a range
	Prefix netip.Prefix // the range when Name is ""
	Port   uint16
}

// ErrPolicy marks a malformed policy; callers map it to a usage error.
var ErrPolicy = errors.New("invalid network policy")

// ParseMode parses a mode name.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(strings.ToLower(s)); m {
	case None, Internet, Allowlist:
		return m, nil
	}
	return "", fmt.Errorf("%w: unknown network mode %q (none, internet, allowlist)", ErrPolicy, s)
}

// ParseRule parses NAME_OR_CIDR[:PORT]: "example.com", "*.example.com:443",
// "93.184.216.34", "10.1.0.0/16:5432".
func ParseRule(s string) (Rule, error) {
	orig := s
	s = strings.TrimSpace(strings.ToLower(s))
	if s == "" {
		return Rule{}, fmt.Errorf("%w: empty entry", ErrPolicy)
	}
	var r Rule
	if strings.Count(s, ":") > 1 || strings.HasPrefix(s, "[") {
		return Rule{}, fmt.Errorf("%w: %q: sandboxes have IPv4 only; IPv6 addresses cannot be allowed or denied", ErrPolicy, orig)
	}
	if host, port, ok := strings.Cut(s, ":"); ok {
		n, err := strconv.ParseUint(port, 10, 16)
		if err != nil || n == 0 {
			return Rule{}, fmt.Errorf("%w: %q: port %q is not 1-65535", ErrPolicy, orig, port)
		}
		r.Port, s = uint16(n), host
	}
	if p, err := netip.ParsePrefix(s); err == nil {
		if !p.Addr().Is4() {
			return Rule{}, fmt.Errorf("%w: %q: sandboxes have IPv4 only", ErrPolicy, orig)
		}
		r.Prefix = p.Masked()
		return r, nil
	}
	if a, err := netip.ParseAddr(s); err == nil {
		if !a.Is4() {
			return Rule{}, fmt.Errorf("%w: %q: sandboxes have IPv4 only", ErrPolicy, orig)
		}
		r.Prefix = netip.PrefixFrom(a, 32)
		return r, nil
	}
	if looksNumeric(s) {
		return Rule{}, fmt.Errorf("%w: %q is neither an IPv4 address, a CIDR nor a name", ErrPolicy, orig)
	}
	name := strings.TrimSuffix(s, ".")
	if err := checkName(strings.TrimPrefix(name, "*.")); err != nil {
		return Rule{}, fmt.Errorf("%w: %q: %v", ErrPolicy, orig, err)
	}
	if strings.Contains(strings.TrimPrefix(name, "*."), "*") {
		return Rule{}, fmt.Errorf("%w: %q: a wildcard may only be a leading \"*.\"", ErrPolicy, orig)
	}
	r.Name = name
	return r, nil
}

// looksNumeric is true for strings made of digits, dots and slashes only
// (a malformed address, not a name).
func looksNumeric(s string) bool {
	for _, c := range s {
		if (c < '0' || c > '9') && c != '.' && c != '/' {
			return false
		}
	}
	return true
}

func checkName(name string) error {
	if len(name) == 0 || len(name) > 253 {
		return errors.New("a name has 1 to 253 characters")
	}
	for _, label := range strings.Split(name, ".") {
		if len(label) == 0 || len(label) > 63 {
			return errors.New("each label of a name has 1 to 63 characters")
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return fmt.Errorf("%q is not allowed in a name", c)
			}
		}
	}
	return nil
}

// String is the rule as ParseRule reads it.
func (r Rule) String() string {
	s := r.Name
	if s == "" {
		s = r.Prefix.String()
		if r.Prefix.Bits() == 32 {
			s = r.Prefix.Addr().String()
		}
	}
	if r.Port != 0 {
		s += ":" + strconv.Itoa(int(r.Port))
	}
	return s
}

// MarshalText and UnmarshalText store a rule as its string.
func (r Rule) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

func (r *Rule) UnmarshalText(b []byte) error {
	v, err := ParseRule(string(b))
	if err != nil {
		return err
	}
	*r = v
	return nil
}

// matches reports whether name is r's name or, for "*.x", a name under x.
func (r Rule) matches(name string) bool {
	if r.Name == "" {
		return false
	}
	if rest, ok := strings.CutPrefix(r.Name, "*."); ok {
		return strings.HasSuffix(name, "."+rest)
	}
	return name == r.Name
}

// Validate checks a policy and fills its mode ("" is none).
func (p *Policy) Validate() error {
	if p.Mode == "" {
		p.Mode = None
	}
	if _, err := ParseMode(string(p.Mode)); err != nil {
		return err
	}
	if p.Mode == None && (len(p.Allow) > 0 || len(p.Deny) > 0) {
		return fmt.Errorf("%w: a sandbox without network (mode none) has nothing to allow or deny", ErrPolicy)
	}
	if p.Mode == Allowlist && len(p.Deny) > 0 {
		return fmt.Errorf("%w: an allowlist denies everything it does not list; deny entries apply to internet mode", ErrPolicy)
	}
	if len(p.Allow)+len(p.Deny) > maxRules {
		return fmt.Errorf("%w: at most %d allow and deny entries", ErrPolicy, maxRules)
	}
	return nil
}

// maxRules bounds a policy (each entry is a rule or a name the resolver checks).
const maxRules = 256

// Networked reports whether the sandbox gets an interface at all.
func (p Policy) Networked() bool { return p.Mode == Internet || p.Mode == Allowlist }

// NamePorts says whether a name may be resolved and, if so, for which ports
// its addresses are allowed (0: every port). Always-denied names never are.
func (p Policy) NamePorts(name string) (bool, []uint16) {
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	if alwaysDeniedName(name) {
		return false, nil
	}
	switch p.Mode {
	case Internet:
		for _, r := range p.Allow {
			if r.matches(name) {
				return true, []uint16{0}
			}
		}
		for _, r := range p.Deny {
			if r.matches(name) {
				return false, nil
			}
		}
		return true, []uint16{0}
	case Allowlist:
		var ports []uint16
		for _, r := range p.Allow {
			if r.matches(name) {
				if r.Port == 0 {
					return true, []uint16{0}
				}
				ports = append(ports, r.Port)
			}
		}
		return len(ports) > 0, ports
	}
	return false, nil
}

// deniedNames are cloud metadata services' names, denied in every mode.
var deniedNames = []string{"metadata.google.internal", "metadata.goog", "metadata", "instance-data", "instance-data.ec2.internal"}

func alwaysDeniedName(name string) bool {
	for _, d := range deniedNames {
		if name == d || strings.HasSuffix(name, "."+d) {
			return true
		}
	}
	return false
}

// learns says whether the addresses of an allowed name need adding to the
// sandbox's learned sets: always in allowlist mode; in internet mode only
// for names an allow entry names (their addresses may be in a denied
// range, or a denied name's).
func (p Policy) learns(name string) bool {
	return p.Mode == Allowlist || p.Mode == Internet && p.allowsByName(name)
}

// deniesName says whether name is one the policy's own deny list keeps the
// sandbox from (internet mode; an allow entry overrides it). The resolver
// answers NXDOMAIN for it, and the addresses it resolves to are denied.
// Always-denied names are not among them: they are never asked upstream.
func (p Policy) deniesName(name string) bool {
	if p.Mode != Internet || alwaysDeniedName(name) || p.allowsByName(name) {
		return false
	}
	for _, r := range p.Deny {
		if r.matches(name) {
			return true
		}
	}
	return false
}

func (p Policy) allowsByName(name string) bool {
	for _, r := range p.Allow {
		if r.matches(name) {
			return true
		}
	}
	return false
}

// exactDenyNames are the names without a wildcard the policy denies: the
// host resolves them itself and keeps their addresses denied. A wildcard
// cannot be enumerated; its names' addresses are denied once the sandbox
// asks for them.
func (p Policy) exactDenyNames() []string {
	if p.Mode != Internet {
		return nil
	}
	var out []string
	for _, r := range p.Deny {
		if r.Name != "" && !strings.HasPrefix(r.Name, "*.") && p.deniesName(r.Name) {
			out = append(out, r.Name)
		}
	}
	return out
}
