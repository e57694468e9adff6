package kube

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// testCert is a self-signed certificate and its key, PEM.
func testCert(t *testing.T) (certPEM, keyPEM []byte) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	kd, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kd})
}

func writeKubeconfig(t *testing.T, dir, user string) string {
	t.Helper()
	conf := `apiVersion: v1
kind: Config
current-context: b
clusters:
- name: other
  cluster: {server: "https://wrong:1"}
- name: c
  cluster:
    server: https://10.0.0.1:6443
    certificate-authority: ca.pem
contexts:
- name: a
  context: {cluster: other, user: u}
- name: b
  context: {cluster: c, user: u}
users:
- name: u
  user:
` + user
	p := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(p, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestKubeconfig: each supported form of a kubeconfig's current context
// (CA file relative to the kubeconfig, inline data, token, token file,
// client certificate as files and inline, insecure-skip-tls-verify).
func TestKubeconfig(t *testing.T) {
	dir := t.TempDir()
	cert, key := testCert(t)
	for name, b := range map[string][]byte{"ca.pem": cert, "crt.pem": cert, "key.pem": key, "tok": []byte("file-token\n")} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	b64 := base64.StdEncoding.EncodeToString

	cfg, err := LoadKubeconfig(writeKubeconfig(t, dir, "    token: abc\n"))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Server != "https://10.0.0.1:6443" || cfg.Token != "abc" || string(cfg.CAData) != string(cert) {
		t.Fatalf("token form: %+v", cfg)
	}
	if _, err := cfg.tlsConfig(); err != nil {
		t.Fatal(err)
	}
	c, err := New(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if tok, _ := c.creds.bearer(); tok != "abc" {
		t.Fatalf("bearer %q", tok)
	}

	cfg, err = LoadKubeconfig(writeKubeconfig(t, dir, "    tokenFile: tok\n"))
	if err != nil {
		t.Fatal(err)
	}
	c, err = New(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if tok, err := c.creds.bearer(); tok != "file-token" || err != nil {
		t.Fatalf("token file: bearer %q, %v", tok, err)
	}

	cfg, err = LoadKubeconfig(writeKubeconfig(t, dir, "    client-certificate: crt.pem\n    client-key: "+filepath.Join(dir, "key.pem")+"\n"))
	if err != nil {
		t.Fatal(err)
	}
	tc, err := cfg.tlsConfig()
	if err != nil || len(tc.Certificates) != 1 || tc.RootCAs == nil {
		t.Fatalf("client certificate files: %v, %v", tc, err)
	}

	cfg, err = LoadKubeconfig(writeKubeconfig(t, dir, "    client-certificate-data: "+b64(cert)+"\n    client-key-data: "+b64(key)+"\n"))
	if err != nil {
		t.Fatal(err)
	}
	if tc, err := cfg.tlsConfig(); err != nil || len(tc.Certificates) != 1 {
		t.Fatalf("client certificate data: %v, %v", tc, err)
	}

	// Inline CA data and insecure-skip-tls-verify (each on its own).
	p := writeKubeconfig(t, dir, "    token: x\n")
	raw, _ := os.ReadFile(p)
	inline := strings.Replace(string(raw), "certificate-authority: ca.pem", "certificate-authority-data: "+b64(cert), 1)
	_ = os.WriteFile(p, []byte(inline), 0o600)
	if cfg, err = LoadKubeconfig(p); err != nil || string(cfg.CAData) != string(cert) {
		t.Fatalf("certificate-authority-data: %v, %v", cfg, err)
	}
	insecure := strings.Replace(string(raw), "certificate-authority: ca.pem", "insecure-skip-tls-verify: true", 1)
	_ = os.WriteFile(p, []byte(insecure), 0o600)
	if cfg, err = LoadKubeconfig(p); err != nil || !cfg.InsecureSkipVerify {
		t.Fatalf("insecure-skip-tls-verify: %v, %v", cfg, err)
	}
	if tc, err := cfg.tlsConfig(); err != nil || !tc.InsecureSkipVerify {
		t.Fatalf("insecure tls config: %v, %v", tc, err)
	}
}

// TestKubeconfigRefuses: what cage cannot do is one line naming the field.
func TestKubeconfigRefuses(t *testing.T) {
	dir := t.TempDir()
	_ = os.WriteFile(filepath.Join(dir, "ca.pem"), []byte("x"), 0o600)
	_ = os.WriteFile(filepath.Join(dir, "crt.pem"), []byte("x"), 0o600)
	for user, want := range map[string]string{
		"    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: aws\n": "exec",
		"    auth-provider:\n      name: gcp\n":                                              "auth-provider",
		"    username: a\n    password: b\n":                                                 "username/password",
		"    as: someone\n":                                                                  "impersonation",
		"    client-certificate: crt.pem\n":                                                  "client certificate needs its key",
	} {
		_, err := LoadKubeconfig(writeKubeconfig(t, dir, user))
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("user %q: err = %v, want one line with %q", user, err, want)
		}
	}
	p := filepath.Join(dir, "bad")
	for conf, want := range map[string]string{
		"current-context: x\n": `"x" is not among its contexts`,
		"kind: Config\n":       "no current-context",
		"current-context: a\ncontexts:\n- name: a\n  context: {cluster: nope}\n": `names cluster "nope"`,
		"{{{": "not a kubeconfig",
	} {
		_ = os.WriteFile(p, []byte(conf), 0o600)
		if _, err := LoadKubeconfig(p); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: err = %v, want %q", conf, err, want)
		}
	}
	if _, err := New(&Config{Server: "ftp://x"}, Options{}); err == nil {
		t.Error("an ftp server accepted")
	}
}
