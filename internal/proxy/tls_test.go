package proxy

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// serveTLS serves h over TLS with c on a loopback port and returns its
// address.
func serveTLS(t *testing.T, c *tls.Config, h http.Handler) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, TLSConfig: c, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(tls.NewListener(l, c)) }()
	t.Cleanup(func() { srv.Close() })
	return l.Addr().String()
}

func caPool(t *testing.T, path string) *x509.CertPool {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(b) {
		t.Fatalf("%s holds no certificate", path)
	}
	return p
}

// handshake dials addr with SNI name, verifying against roots.
func handshake(addr, name string, roots *x509.CertPool) error {
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, &tls.Config{ServerName: name, RootCAs: roots})
	if err == nil {
		c.Close()
	}
	return err
}

func TestTLSSelfSigned(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tls")
	c, err := NewTLS(TLSOptions{SelfSigned: true, Dir: dir, Domain: "cage.test:3001"})
	if err != nil {
		t.Fatal(err)
	}
	// The CA's key is the owner's alone, in a directory that is too.
	for path, want := range map[string]os.FileMode{dir: 0o700, filepath.Join(dir, caKeyName): 0o600, c.CAFile: 0o644} {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s: mode %04o, want %04o", path, fi.Mode().Perm(), want)
		}
	}
	roots := caPool(t, c.CAFile)
	var served atomic.Int32
	addr := serveTLS(t, c.Config, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		io.WriteString(w, "hello "+r.Host)
	}))

	// Names under the domain (one label, as {port}-{id}), the domain itself
	// and localhost verify against the CA; no SNI (a client dialling an IP)
	// is served the same certificate, valid for loopback's addresses.
	for _, name := range []string{"6080-abc123.cage.test", "cage.test", "localhost", "6080-ABC.Cage.Test."} {
		if err := handshake(addr, name, roots); err != nil {
			t.Errorf("handshake for %q: %v, want a certificate the CA verifies", name, err)
		}
	}
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}}
	resp, err := client.Get("https://" + addr + "/")
	if err != nil {
		t.Fatalf("GET https://%s (no SNI, IP SAN): %v", addr, err)
	}
	resp.Body.Close()

	// Hostile: names the proxy was not given are refused in the handshake
	// (no certificate at all, so no page of the proxy's either).
	for _, name := range []string{"example.com", "cage.test.evil.example", "a.b.cage.test", "xcage.test"} {
		err := handshake(addr, name, nil)
		if err == nil || !strings.Contains(err.Error(), "internal error") && !strings.Contains(err.Error(), "unrecognized name") {
			t.Errorf("handshake for %q: %v, want a refused handshake", name, err)
		}
	}

	// Hostile: plain HTTP on the TLS port gets 400 from Go's server and
	// never reaches the handler.
	before := served.Load()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	io.WriteString(conn, "GET / HTTP/1.1\r\nHost: 6080-abc.cage.test\r\n\r\n")
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	status, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || !strings.Contains(status, "400") {
		t.Errorf("plain HTTP on the TLS port: %q, %v; want 400", status, err)
	}
	if served.Load() != before {
		t.Errorf("plain HTTP on the TLS port reached the handler")
	}

	// The CA is name-constrained: a certificate it signs for another name
	// does not verify, so trusting it trusts only the sandbox domain.
	keyPEM, err := os.ReadFile(filepath.Join(dir, caKeyName))
	if err != nil {
		t.Fatal(err)
	}
	ca, caKey, err := parseCA(keyPEM, c.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: serial(), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		Subject: pkix.Name{CommonName: "www.example.com"}, DNSNames: []string{"www.example.com"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	other, _ := x509.ParseCertificate(der)
	if _, err := other.Verify(x509.VerifyOptions{Roots: roots, DNSName: "www.example.com"}); err == nil {
		t.Errorf("a certificate for www.example.com signed by cage's CA verifies; want the name constraint to refuse it")
	}

	// The SPKI pin is the CA's public key's SHA-256.
	sum := sha256.Sum256(ca.RawSubjectPublicKeyInfo)
	if c.CASPKI != base64.StdEncoding.EncodeToString(sum[:]) {
		t.Errorf("CASPKI %q is not the CA's key's hash", c.CASPKI)
	}

	// A restart keeps the CA users trust; another domain gets a new one.
	again, err := NewTLS(TLSOptions{SelfSigned: true, Dir: dir, Domain: "cage.test"})
	if err != nil || again.CASPKI != c.CASPKI {
		t.Errorf("second start: %v, CA %q, want the same CA %q", err, again.CASPKI, c.CASPKI)
	}
	moved, err := NewTLS(TLSOptions{SelfSigned: true, Dir: dir, Domain: "sandbox.example.org"})
	if err != nil || moved.CASPKI == c.CASPKI {
		t.Errorf("another domain: %v, CA %q, want a new CA", err, moved.CASPKI)
	}

	// Hostile: a CA key others may read is refused, not used.
	if err := os.Chmod(filepath.Join(dir, caKeyName), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := NewTLS(TLSOptions{SelfSigned: true, Dir: dir, Domain: "sandbox.example.org"}); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Errorf("CA key of mode 0644: %v, want a refusal naming chmod 600", err)
	}
}

// writeCert writes a self-signed certificate for *.example.test and its
// key (of mode keyMode) and returns their paths.
func writeCert(t *testing.T, keyMode os.FileMode) (certPath, keyPath string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: serial(), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		Subject: pkix.Name{CommonName: "*.example.test"}, DNSNames: []string{"*.example.test"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalECPrivateKey(key)
	dir := t.TempDir()
	certPath, keyPath = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyPath, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), keyMode); err != nil {
		t.Fatal(err)
	}
	return certPath, keyPath
}

func TestTLSCertFiles(t *testing.T) {
	cert, key := writeCert(t, 0o600)
	c, err := NewTLS(TLSOptions{CertFile: cert, KeyFile: key, Domain: "example.test"})
	if err != nil {
		t.Fatal(err)
	}
	if c.CAFile != "" {
		t.Errorf("an operator's certificate has a CA file %q", c.CAFile)
	}
	addr := serveTLS(t, c.Config, http.NotFoundHandler())
	if err := handshake(addr, "6080-abc.example.test", caPool(t, cert)); err != nil {
		t.Errorf("handshake for a name under the domain: %v", err)
	}
	for _, name := range []string{"localhost", "example.com"} {
		if err := handshake(addr, name, nil); err == nil {
			t.Errorf("handshake for %q succeeded; want it refused", name)
		}
	}
}

// TestTLSRefused: what cage serve must refuse to start with, each with a
// one-line reason.
func TestTLSRefused(t *testing.T) {
	cert, key := writeCert(t, 0o600)
	_, loose := writeCert(t, 0o640)
	link := filepath.Join(t.TempDir(), "key-link.pem")
	if err := os.Symlink(key, link); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		o    TLSOptions
		want string
	}{
		{"key readable by its group", TLSOptions{CertFile: cert, KeyFile: loose}, "chmod 600"},
		{"key through a symlink", TLSOptions{CertFile: cert, KeyFile: link}, "symbolic link"},
		{"key missing", TLSOptions{CertFile: cert, KeyFile: key + ".none"}, "no such file"},
		{"certificate without key", TLSOptions{CertFile: cert}, "both"},
		{"key that is not the certificate's", TLSOptions{CertFile: writeCertOnly(t), KeyFile: key}, "private key does not match"},
		{"both a file and self-signed", TLSOptions{CertFile: cert, KeyFile: key, SelfSigned: true}, "give one"},
		{"self-signed without a domain", TLSOptions{SelfSigned: true, Dir: t.TempDir()}, "--domain"},
		{"nothing", TLSOptions{}, "no certificate"},
		{"a domain that is not a name", TLSOptions{SelfSigned: true, Dir: t.TempDir(), Domain: "cage.localhost:127.0.0.1:3001"}, "not a DNS name"},
		{"a domain of one label", TLSOptions{SelfSigned: true, Dir: t.TempDir(), Domain: "localhost:3001"}, "not a DNS name"},
	} {
		_, err := NewTLS(c.o)
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %v; want one line containing %q", c.name, err, c.want)
		}
	}
}

func writeCertOnly(t *testing.T) string {
	cert, _ := writeCert(t, 0o600)
	return cert
}

// TestRouteDomainWithPort: a domain that carries the proxy's port (what
// the SDKs put in their https URLs for a local daemon) routes by its name.
func TestRouteDomainWithPort(t *testing.T) {
	p := New(sandboxes{}, "cage.localhost:3001", nil)
	for host, ok := range map[string]bool{
		"6080-abc.cage.localhost:3001": true,
		"6080-abc.cage.localhost":      true,
		"6080-abc.localhost:3001":      false,
		"6080-abc.cage.localhost.evil": false,
	} {
		r := httptest.NewRequest("GET", "/vnc.html", nil)
		r.Host = host
		id, port, got := p.route(r)
		if got != ok || ok && (id != "abc" || port != 6080) {
			t.Errorf("route(%q) = %q, %d, %v; want ok %v", host, id, port, got, ok)
		}
	}
}
