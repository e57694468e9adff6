package proxy

// TLS for the proxy's listener. E2B's SDKs build https:// URLs for host-
// routed ports ({port}-{sandboxID}.{domain}); @e2b/desktop's stream URL is
// always https://…/vnc.html. The proxy serves TLS with the operator's
// certificate (a wildcard for the sandbox domain), or, for local use, with a
// certificate made at each start and signed by a CA that cage makes once
// under its data directory: its key stays there (0600, never sent, never
// printed); its certificate is what a user trusts. The CA is name-
// constrained to the sandbox domain and loopback, so trusting it trusts
// nothing else.

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// TLSOptions say where the proxy's certificate comes from: files, or
// SelfSigned (a CA kept in Dir).
type TLSOptions struct {
	CertFile, KeyFile string
	SelfSigned        bool
	Dir               string // the self-signed CA's directory (DATA/tls)
	Domain            string // the sandbox domain; a port on it is ignored
}

// TLS is the proxy's TLS configuration.
type TLS struct {
	Config *tls.Config
	// CAFile is the self-signed CA's certificate (PEM), and CASPKI the
	// base64 SHA-256 of its public key (Chromium's
	// --ignore-certificate-errors-spki-list, HPKP's pin format); empty with
	// an operator's certificate.
	CAFile, CASPKI string
}

// Files of the self-signed CA in TLSOptions.Dir.
const (
	CACertName = "ca.pem"
	caKeyName  = "ca-key.pem"
)

// NewTLS loads or makes the proxy's certificate. A handshake whose server
// name (SNI) is neither the domain nor a name under it (nor, for the
// self-signed certificate, localhost) is refused, so that the proxy does
// not answer for names it was not given; a client that sends none (one
// that dials an IP address) gets the certificate.
func NewTLS(o TLSOptions) (*TLS, error) {
	if err := CheckTLSOptions(o); err != nil {
		return nil, err
	}
	domain := DomainHost(o.Domain)
	t := &TLS{}
	var get func() (*tls.Certificate, error)
	switch {
	case o.CertFile != "":
		keyPEM, err := readPrivate(o.KeyFile)
		if err != nil {
			return nil, err
		}
		certPEM, err := os.ReadFile(o.CertFile)
		if err != nil {
			return nil, fmt.Errorf("tls: certificate: %w", err)
		}
		cert, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			return nil, fmt.Errorf("tls: %s and %s: %w", o.CertFile, o.KeyFile, err)
		}
		get = func() (*tls.Certificate, error) { return &cert, nil }
	case o.SelfSigned:
		ca, caKey, err := loadOrMakeCA(o.Dir, domain)
		if err != nil {
			return nil, err
		}
		sum := sha256.Sum256(ca.RawSubjectPublicKeyInfo)
		t.CAFile, t.CASPKI = filepath.Join(o.Dir, CACertName), base64.StdEncoding.EncodeToString(sum[:])
		get = leafMaker(ca, caKey, domain)
	}
	t.Config = &tls.Config{MinVersion: tls.VersionTLS12,
		GetCertificate: func(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
			if !nameServed(hello.ServerName, domain, o.SelfSigned) {
				return nil, fmt.Errorf("tls: no certificate for server name %q", hello.ServerName)
			}
			return get()
		}}
	return t, nil
}

// CheckTLSOptions says what is wrong with o without writing anything (the
// CLI's usage errors); NewTLS checks it too.
func CheckTLSOptions(o TLSOptions) error {
	domain := DomainHost(o.Domain)
	switch {
	case (o.CertFile != "") != (o.KeyFile != ""):
		return errors.New("tls: give both the certificate and the key (--tls-cert and --tls-key)")
	case o.SelfSigned && o.CertFile != "":
		return errors.New("tls: a certificate file and a self-signed certificate are two choices; give one")
	case !o.SelfSigned && o.CertFile == "":
		return errors.New("tls: no certificate (--tls-cert and --tls-key, or --tls-self-signed)")
	case o.SelfSigned && domain == "":
		return errors.New("tls: a self-signed certificate needs the sandbox domain (--domain, e.g. cage.localhost:3001)")
	case o.SelfSigned && (!dnsName(domain) || !strings.Contains(domain, ".")):
		return fmt.Errorf("tls: the sandbox domain %q is not a DNS name with a dot, optionally with a port (e.g. cage.localhost:3001)", o.Domain)
	case o.CertFile != "":
		keyPEM, err := readPrivate(o.KeyFile)
		if err != nil {
			return err
		}
		certPEM, err := os.ReadFile(o.CertFile)
		if err != nil {
			return fmt.Errorf("tls: certificate: %w", err)
		}
		if _, err := tls.X509KeyPair(certPEM, keyPEM); err != nil {
			return fmt.Errorf("tls: %s and %s: %w", o.CertFile, o.KeyFile, err)
		}
	}
	return nil
}

// DomainHost is the sandbox domain without a port.
func DomainHost(domain string) string {
	if h, _, err := net.SplitHostPort(domain); err == nil {
		return h
	}
	return domain
}

// dnsName says whether s is a DNS name: labels of letters, digits and
// hyphens, none empty.
func dnsName(s string) bool {
	if len(s) > 253 {
		return false
	}
	for _, l := range strings.Split(s, ".") {
		if l == "" || len(l) > 63 || l[0] == '-' || l[len(l)-1] == '-' {
			return false
		}
		for _, c := range l {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}

// nameServed says whether the proxy answers a handshake for SNI name.
func nameServed(name, domain string, selfSigned bool) bool {
	name = strings.ToLower(strings.TrimSuffix(name, "."))
	switch {
	case name == "" || domain == "":
		return true
	case name == domain || selfSigned && name == "localhost":
		return true
	}
	label, ok := strings.CutSuffix(name, "."+domain)
	return ok && label != "" && !strings.Contains(label, ".")
}

// readPrivate reads a private key file that only its owner may read: a key
// others can read is refused, as ssh refuses one.
func readPrivate(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("tls: key: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("tls: key: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("tls: key %s is not a regular file", path)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("tls: key %s may be read by others (mode %04o): chmod 600 it", path, fi.Mode().Perm())
	}
	return io.ReadAll(io.LimitReader(f, 1<<20))
}

// loadOrMakeCA returns the CA kept in dir, made anew when there is none or
// when its name constraints do not cover domain.
func loadOrMakeCA(dir, domain string) (*x509.Certificate, crypto.Signer, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, nil, fmt.Errorf("tls: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, nil, fmt.Errorf("tls: %w", err)
	}
	keyPath, certPath := filepath.Join(dir, caKeyName), filepath.Join(dir, CACertName)
	if keyPEM, err := readPrivate(keyPath); err == nil {
		ca, key, err := parseCA(keyPEM, certPath)
		if err != nil {
			return nil, nil, fmt.Errorf("tls: the CA in %s: %w (remove the directory to make a new one)", dir, err)
		}
		if slices.Contains(ca.PermittedDNSDomains, domain) && time.Until(ca.NotAfter) > 30*24*time.Hour {
			return ca, key, nil
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, nil, err
	}
	return makeCA(keyPath, certPath, domain)
}

func parseCA(keyPEM []byte, certPath string) (*x509.Certificate, crypto.Signer, error) {
	certPEM, err := os.ReadFile(certPath)
	if err != nil {
		return nil, nil, err
	}
	cb, _ := pem.Decode(certPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		return nil, nil, errors.New("not PEM")
	}
	ca, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, nil, err
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, nil, err
	}
	if !key.PublicKey.Equal(ca.PublicKey) {
		return nil, nil, errors.New("the key is not the certificate's")
	}
	return ca, key, nil
}

func makeCA(keyPath, certPath, domain string) (*x509.Certificate, crypto.Signer, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	host, _ := os.Hostname()
	now := time.Now()
	tmpl := &x509.Certificate{SerialNumber: serial(), NotBefore: now.Add(-time.Hour), NotAfter: now.AddDate(5, 0, 0),
		Subject: pkix.Name{Organization: []string{"cage"}, CommonName: "cage local CA for " + domain + " (" + host + ")"},
		IsCA:    true, BasicConstraintsValid: true, MaxPathLenZero: true,
		KeyUsage:                    x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		PermittedDNSDomainsCritical: true, PermittedDNSDomains: []string{domain, "localhost"},
		PermittedIPRanges: []*net.IPNet{{IP: net.IPv4(127, 0, 0, 0).To4(), Mask: net.CIDRMask(8, 32)},
			{IP: net.IPv6loopback, Mask: net.CIDRMask(128, 128)}}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, err
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	// The key first, 0600 from its creation: a file already there (a CA
	// for another domain) is replaced whole, never written through.
	if err := writeNew(keyPath, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		return nil, nil, err
	}
	if err := writeNew(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		return nil, nil, err
	}
	return ca, key, nil
}

// writeNew writes a file beside path and renames it over path.
func writeNew(path string, b []byte, mode os.FileMode) error {
	tmp := path + ".new"
	_ = os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, mode)
	if err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("tls: %w", err)
	}
	return nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	return n
}

// leafMaker returns the certificate for the domain, its wildcard,
// localhost and loopback, signed by ca; made in memory (its key is never
// written) and made again once it nears its end.
func leafMaker(ca *x509.Certificate, caKey crypto.Signer, domain string) func() (*tls.Certificate, error) {
	var mu sync.Mutex
	var cur *tls.Certificate
	return func() (*tls.Certificate, error) {
		mu.Lock()
		defer mu.Unlock()
		if cur != nil && time.Until(cur.Leaf.NotAfter) > 24*time.Hour {
			return cur, nil
		}
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, err
		}
		now := time.Now()
		tmpl := &x509.Certificate{SerialNumber: serial(), NotBefore: now.Add(-time.Hour), NotAfter: now.AddDate(0, 0, 30),
			Subject:     pkix.Name{Organization: []string{"cage"}, CommonName: "*." + domain},
			DNSNames:    []string{domain, "*." + domain, "localhost"},
			IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
			KeyUsage:    x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			return nil, err
		}
		leaf, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, err
		}
		cur = &tls.Certificate{Certificate: [][]byte{der, ca.Raw}, PrivateKey: key, Leaf: leaf}
		return cur, nil
	}
}
