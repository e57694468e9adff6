package e2b

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestDesktop runs desktop.test.mjs, the real @e2b/desktop 2.4.0 against
// sandboxes of the template desktop (scripts/test.sh builds it), through a
// daemon whose proxy speaks TLS with its self-signed CA, as the SDK's
// https://6080-{id}.{domain}/vnc.html stream URL needs: the SDK trusts the
// CA through NODE_EXTRA_CA_CERTS, Debian's Chromium (driven by
// playwright-core) through an NSS database. The process, runc and gVisor
// walls run (about 40, 30 and 50 s here); CAGE_TEST_DESKTOP_WALLS names
// others (microvm: under TCG its create alone takes minutes, see
// docs/SPECIFICATION.md).
func TestDesktop(t *testing.T) {
	requireDesktop(t)
	chromium := requireChromium(t)
	walls := []string{"process", "runc", "gvisor"}
	if v := os.Getenv("CAGE_TEST_DESKTOP_WALLS"); v != "" {
		walls = strings.Split(v, ",")
	}
	for _, wall := range walls {
		t.Run(wall, func(t *testing.T) {
			if wall != "process" {
				requireWall(t, wall)
			}
			d := startDaemon(t, "--wall", wall, "--tls-self-signed", "--domain", "cage.localhost:{proxy-port}")
			ca := filepath.Join(d.data, "tls", "ca.pem")
			checkProxyTLS(t, strings.TrimPrefix(d.proxyURL, "https://"), ca)
			env := append(d.sdkEnv("e2b", d.key), "NODE_EXTRA_CA_CERTS="+ca, "CAGE_TEST_CA="+ca,
				"CAGE_TEST_CHROMIUM="+chromium, "CAGE_TEST_WALL="+wall)
			args := []string{"--test", "--test-reporter=spec", "desktop.test.mjs"}
			if err := runNode(t, sdkDir(t), env, 20*time.Minute, args...); err != nil {
				t.Errorf("@e2b/desktop on the %s wall failed: %v (the daemon's log follows the test)", wall, err)
			}
			d.checkNoSandboxesLeft(t)
			d.stop(t)
		})
	}
}

// checkProxyTLS checks the daemon's TLS proxy from outside: the sandbox
// domain's names verify against the CA it printed; a name it was not
// given gets no certificate; plain HTTP on the port gets 400; the CA's key
// is the owner's alone.
func checkProxyTLS(t *testing.T, addr, caFile string) {
	t.Helper()
	pem, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatalf("the self-signed CA: %v", err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	dial := func(name string) error {
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, &tls.Config{ServerName: name, RootCAs: roots})
		if err == nil {
			c.Close()
		}
		return err
	}
	if err := dial("6080-abcdef.cage.localhost"); err != nil {
		t.Errorf("TLS handshake for 6080-abcdef.cage.localhost: %v; want a certificate the printed CA verifies", err)
	}
	if err := dial("www.example.com"); err == nil {
		t.Errorf("TLS handshake for www.example.com succeeded; want it refused (not the sandbox domain)")
	}
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	_, _ = io.WriteString(c, "GET /health HTTP/1.1\r\nHost: 49983-abcdef.cage.localhost\r\n\r\n")
	if line, err := bufio.NewReader(c).ReadString('\n'); err != nil || !strings.Contains(line, " 400 ") {
		t.Errorf("plain HTTP on the TLS port: %q, %v; want 400", line, err)
	}
	if fi, err := os.Stat(filepath.Join(filepath.Dir(caFile), "ca-key.pem")); err != nil {
		t.Errorf("the CA's key: %v", err)
	} else if fi.Mode().Perm() != 0o600 {
		t.Errorf("the CA's key has mode %04o; want 0600", fi.Mode().Perm())
	}
}

// requireDesktop skips unless the shared template store has desktop;
// where scripts/test.sh built it (CAGE_REQUIRE_DESKTOP) its absence fails.
func requireDesktop(t *testing.T) {
	t.Helper()
	dir := os.Getenv("CAGE_TEMPLATES")
	if dir != "" {
		if _, err := os.Stat(filepath.Join(dir, "templates", "desktop.json")); err == nil {
			return
		}
	}
	if os.Getenv("CAGE_REQUIRE_DESKTOP") != "" {
		t.Fatalf("CAGE_REQUIRE_DESKTOP is set but the template store %q has no desktop (make desktop)", dir)
	}
	t.Skipf("SKIP: the template store (CAGE_TEMPLATES=%q) has no desktop: make desktop builds it", dir)
}

// requireChromium finds Debian's Chromium binary and certutil (the test
// trusts the CA through an NSS database); scripts/test.sh installs both.
func requireChromium(t *testing.T) string {
	t.Helper()
	skip := t.Skipf
	if os.Getenv("CAGE_REQUIRE_DESKTOP") != "" {
		skip = t.Fatalf
	}
	if _, err := exec.LookPath("certutil"); err != nil {
		skip("SKIP: needs certutil (libnss3-tools) to trust cage's CA in Chromium")
	}
	for _, p := range []string{"/usr/lib/chromium/chromium", "/usr/bin/chromium"} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	skip("SKIP: needs Debian's chromium package")
	return ""
}
