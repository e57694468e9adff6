// Package kubeplane runs a real, small Kubernetes control plane for cage's
// cluster tests and benchmarks: etcd, kube-apiserver and kube-scheduler,
// the binaries scripts/kube.sh builds from the Go module proxy (scripts/test.sh
// caches them and names their directory in CAGE_KUBE_DIR). There is no
// controller-manager and no kubelet: cage's nodes are the kubelets, and
// cage runs its own node-lifecycle logic.
//
// The apiserver authenticates with a static token file (user "admin" in
// system:masters; a user "cage:node:NAME" in group "cage:nodes" for each
// node name given) and authorizes with RBAC only; the harness grants the
// node users nothing (the cluster package applies its own RBAC). It serves
// TLS with a CA and certificate made here, and signs service-account tokens
// with a key made here. The admission plugins ServiceAccount and
// TaintNodesByCondition are off: without a controller-manager, nothing
// would make the accounts the one requires or lift the not-ready taint the
// other puts on every new Node.
//
// Topology adds the network of a cluster on one machine: a bridge with the
// host's address and one network namespace per node, joined to it by a veth.
package kubeplane

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/freeport"
)

// EnvDir names the directory of etcd, kube-apiserver and kube-scheduler.
const EnvDir = "CAGE_KUBE_DIR"

// Admin is the user with every right (group system:masters).
const Admin = "admin"

// NodeGroup is the group of every node user; NodeUser(name) its user name.
const NodeGroup = "cage:nodes"

// NodeUser is the user name a node authenticates as.
func NodeUser(node string) string { return "cage:node:" + node }

// KubeletGroup is the group of every kubelet; KubeletUser(name) the user
// name of node name's kubelet.
const KubeletGroup = "system:nodes"

// KubeletUser is the user name node's kubelet authenticates as.
func KubeletUser(node string) string { return "system:node:" + node }

// Options shape a plane. The zero value is a plane on loopback.
type Options struct {
	// BindIP is the apiserver's address (default 127.0.0.1); give
	// Net.HostIP for nodes in network namespaces to reach it.
	BindIP net.IP
	// Nodes are the node names that get a token (user cage:node:NAME).
	Nodes []string
	// Kubelets are names of ordinary nodes of a shared cluster that get
	// a token as their kubelet's (user system:node:NAME, group
	// system:nodes). The plane authorizes with RBAC only: a test grants
	// them what the Node authorizer would.
	Kubelets []string
	// Dir keeps the plane's files (certificates, tokens, etcd's data, the
	// logs); Start uses a test temporary directory when it is empty.
	Dir string
	// Fsync makes etcd sync its writes to disk, as in production; by
	// default it does not (--unsafe-no-fsync), which tests need on a
	// machine shared by many.
	Fsync bool
	// Log, when set, receives every process's output too.
	Log io.Writer
	// Audit makes the apiserver log every request's metadata (who, verb,
	// object; no bodies) to Plane.AuditLog, as JSON lines.
	Audit bool
	// APIServerArgs are more flags of kube-apiserver (internal/kube's
	// test turns the watch cache of secrets off, so that a watch from a
	// compacted resourceVersion reaches etcd and is answered 410).
	APIServerArgs []string
}

// Plane is a running control plane.
type Plane struct {
	URL     string // https://IP:port of the apiserver
	CAFile  string // the CA that signed the apiserver's certificate
	Dir     string
	EtcdURL string // http://127.0.0.1:port
	// AuditLog is the apiserver's audit log (Options.Audit), else "".
	AuditLog string

	tokens map[string]string // user -> bearer token
	caPEM  []byte
	procs  []*proc
	http   *http.Client
}

// Start runs a plane for a test, stopped by the test's cleanup. Without the
// binaries it skips the test, or fails it where CAGE_REQUIRE_WALLS is set
// (CI, as root), which says every part of the suite must run.
func Start(t testing.TB, o Options) *Plane {
	t.Helper()
	if _, err := BinDir(); err != nil {
		if os.Getenv("CAGE_REQUIRE_WALLS") != "" {
			t.Fatalf("the cluster tests are required here (CAGE_REQUIRE_WALLS) but: %v", err)
		}
		t.Skipf("no Kubernetes control plane: %v (scripts/test.sh builds it as root)", err)
	}
	if o.Dir == "" {
		o.Dir = t.TempDir()
	}
	p, err := Launch(o)
	if err != nil {
		t.Fatalf("control plane: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			p.dumpLogs(t)
		}
		p.Stop()
	})
	return p
}

// BinDir returns $CAGE_KUBE_DIR once it holds the three binaries.
func BinDir() (string, error) {
	dir := os.Getenv(EnvDir)
	if dir == "" {
		return "", errors.New(EnvDir + " is not set")
	}
	for _, b := range []string{"etcd", "kube-apiserver", "kube-scheduler"} {
		if fi, err := os.Stat(filepath.Join(dir, b)); err != nil || fi.Mode()&0o111 == 0 {
			return "", fmt.Errorf("%s: no executable %s in %s", EnvDir, b, dir)
		}
	}
	return dir, nil
}

// Launch runs a plane outside a test (cage bench); the caller must Stop it.
// o.Dir must be set.
func Launch(o Options) (p *Plane, err error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	if o.Dir == "" {
		return nil, errors.New("kubeplane: Options.Dir is empty")
	}
	if o.BindIP == nil {
		o.BindIP = net.IPv4(127, 0, 0, 1)
	}
	if err := os.MkdirAll(o.Dir, 0o700); err != nil {
		return nil, err
	}
	plane := &Plane{Dir: o.Dir, CAFile: filepath.Join(o.Dir, "ca.crt"), tokens: map[string]string{}}
	defer func() {
		if err != nil {
			plane.Stop()
		}
	}()
	p = plane
	ips := []net.IP{o.BindIP, net.IPv4(127, 0, 0, 1)}
	pk, err := makePKI(o.Dir, ips)
	if err != nil {
		return nil, err
	}
	p.caPEM = pk.caPEM
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pk.caPEM)
	p.http = &http.Client{Timeout: 10 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	tokenFile, err := p.writeTokens(o.Nodes, o.Kubelets)
	if err != nil {
		return nil, err
	}
	if err := p.startEtcd(bin, o); err != nil {
		return nil, err
	}
	if err := p.startAPIServer(bin, o, pk, tokenFile); err != nil {
		return nil, err
	}
	if err := p.waitReady(90 * time.Second); err != nil {
		return nil, err
	}
	if err := p.ensureNamespaces("default", "kube-system", "kube-public", "kube-node-lease"); err != nil {
		return nil, err
	}
	if err := p.startScheduler(bin, o); err != nil {
		return nil, err
	}
	return p, nil
}

// writeTokens writes the static token file: one random token per user.
func (p *Plane) writeTokens(nodes, kubelets []string) (string, error) {
	var b strings.Builder
	add := func(user, groups string) {
		tok := randHex(24)
		p.tokens[user] = tok
		fmt.Fprintf(&b, "%s,%s,%s,\"%s\"\n", tok, user, user, groups)
	}
	add(Admin, "system:masters")
	add("system:kube-scheduler", "")
	for _, n := range nodes {
		if n == "" || strings.ContainsAny(n, ",\"\n") {
			return "", fmt.Errorf("kubeplane: bad node name %q", n)
		}
		add(NodeUser(n), NodeGroup)
	}
	for _, n := range kubelets {
		if n == "" || strings.ContainsAny(n, ",\"\n") {
			return "", fmt.Errorf("kubeplane: bad kubelet name %q", n)
		}
		add(KubeletUser(n), KubeletGroup)
	}
	f := filepath.Join(p.Dir, "tokens.csv")
	return f, os.WriteFile(f, []byte(b.String()), 0o600)
}

func (p *Plane) startEtcd(bin string, o Options) error {
	client, peer := freePort("127.0.0.1"), freePort("127.0.0.1")
	p.EtcdURL = "http://127.0.0.1:" + client
	peerURL := "http://127.0.0.1:" + peer
	args := []string{"--name", "cage", "--data-dir", filepath.Join(p.Dir, "etcd"),
		"--listen-client-urls", p.EtcdURL, "--advertise-client-urls", p.EtcdURL,
		"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "cage=" + peerURL, "--log-level", "warn"}
	if !o.Fsync {
		args = append(args, "--unsafe-no-fsync")
	}
	if err := p.run(filepath.Join(bin, "etcd"), "etcd", o.Log, args...); err != nil {
		return err
	}
	return waitFor(30*time.Second, p.procs[len(p.procs)-1], func() error {
		resp, err := http.Get(p.EtcdURL + "/health")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if !bytes.Contains(body, []byte(`"true"`)) {
			return fmt.Errorf("etcd health: %s", body)
		}
		return nil
	})
}

func (p *Plane) startAPIServer(bin string, o Options, pk *pki, tokenFile string) error {
	port := freePort(o.BindIP.String())
	p.URL = "https://" + net.JoinHostPort(o.BindIP.String(), port)
	args := []string{
		"--etcd-servers", p.EtcdURL,
		"--bind-address", o.BindIP.String(), "--secure-port", port,
		"--advertise-address", o.BindIP.String(),
		"--tls-cert-file", pk.certFile, "--tls-private-key-file", pk.keyFile,
		"--client-ca-file", pk.caFile,
		"--token-auth-file", tokenFile, "--anonymous-auth=false",
		"--authorization-mode", "RBAC",
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", pk.saPub, "--service-account-signing-key-file", pk.saKey,
		"--service-cluster-ip-range", "10.196.0.0/16",
		// No controller makes service accounts, nor lifts the not-ready
		// taint TaintNodesByCondition puts on a new Node (the node
		// lifecycle controller would): cage's nodes report their own
		// readiness and cage taints lost nodes itself.
		"--disable-admission-plugins", "ServiceAccount,TaintNodesByCondition",
		"--endpoint-reconciler-type", "none",
		"--profiling=false",
		"--cert-dir", filepath.Join(p.Dir, "certs"),
		"--v", "1",
	}
	if o.Audit {
		policy := filepath.Join(p.Dir, "audit-policy.yaml")
		rules := "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n"
		if err := os.WriteFile(policy, []byte(rules), 0o600); err != nil {
			return err
		}
		p.AuditLog = filepath.Join(p.Dir, "audit.log")
		args = append(args, "--audit-policy-file", policy, "--audit-log-path", p.AuditLog, "--audit-log-format", "json")
	}
	args = append(args, o.APIServerArgs...)
	return p.run(filepath.Join(bin, "kube-apiserver"), "kube-apiserver", o.Log, args...)
}

func (p *Plane) startScheduler(bin string, o Options) error {
	kc, err := p.Kubeconfig("system:kube-scheduler")
	if err != nil {
		return err
	}
	cfg := filepath.Join(p.Dir, "scheduler.yaml")
	conf := fmt.Sprintf(`apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: %q
  qps: 500
  burst: 1000
leaderElection:
  leaderElect: false
`, kc)
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		return err
	}
	return p.run(filepath.Join(bin, "kube-scheduler"), "kube-scheduler", o.Log,
		"--config", cfg, "--secure-port", "0", "--v", "1")
}

// waitReady waits for the apiserver's /readyz, as the admin.
func (p *Plane) waitReady(limit time.Duration) error {
	api := p.procs[len(p.procs)-1]
	return waitFor(limit, api, func() error {
		code, body, err := p.do(http.MethodGet, "/readyz", nil)
		if err != nil {
			return err
		}
		if code != http.StatusOK {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		return nil
	})
}

// ensureNamespaces makes the namespaces the apiserver's own controller
// makes too, so that a test does not wait for it.
func (p *Plane) ensureNamespaces(names ...string) error {
	for _, n := range names {
		body := fmt.Sprintf(`{"apiVersion":"v1","kind":"Namespace","metadata":{"name":%q}}`, n)
		code, out, err := p.do(http.MethodPost, "/api/v1/namespaces", []byte(body))
		if err != nil {
			return err
		}
		if code != http.StatusCreated && code != http.StatusConflict {
			return fmt.Errorf("create namespace %s: %d %s", n, code, out)
		}
	}
	return nil
}

// do sends one request to the apiserver as the admin; accept, when
// given, is its Accept header.
func (p *Plane) do(method, path string, body []byte, accept ...string) (int, []byte, error) {
	req, err := http.NewRequestWithContext(context.Background(), method, p.URL+path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Authorization", "Bearer "+p.tokens[Admin])
	req.Header.Set("Content-Type", "application/json")
	if len(accept) > 0 {
		req.Header.Set("Accept", accept[0])
	}
	resp, err := p.http.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	return resp.StatusCode, out, err
}

// Get reads path from the apiserver as the admin (for /metrics, say) and
// fails unless it answers 200; accept, when given, is the Accept header
// ("application/vnd.kubernetes.protobuf" for an object as etcd keeps it).
func (p *Plane) Get(path string, accept ...string) ([]byte, error) {
	code, body, err := p.do(http.MethodGet, path, nil, accept...)
	if err == nil && code != http.StatusOK {
		err = fmt.Errorf("GET %s: %d %s", path, code, firstLine(body))
	}
	return body, err
}

// Token returns the bearer token of user ("admin", a node name, or a user
// name), or "" if the plane has none.
func (p *Plane) Token(user string) string {
	if tok, ok := p.tokens[user]; ok {
		return tok
	}
	return p.tokens[NodeUser(user)]
}

// Kubeconfig writes (once) and returns the path of a kubeconfig for user:
// "admin", a node name given in Options.Nodes, or a user name.
func (p *Plane) Kubeconfig(user string) (string, error) {
	tok := p.Token(user)
	if tok == "" {
		return "", fmt.Errorf("kubeplane: no user %q", user)
	}
	path := filepath.Join(p.Dir, "kubeconfig-"+strings.NewReplacer(":", "_", "/", "_").Replace(user))
	conf := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: cage
  cluster:
    server: %s
    certificate-authority: %s
users:
- name: %s
  user:
    token: %s
contexts:
- name: cage
  context:
    cluster: cage
    user: %s
current-context: cage
`, p.URL, p.CAFile, strconv.Quote(user), tok, strconv.Quote(user))
	return path, os.WriteFile(path, []byte(conf), 0o600)
}

// MustKubeconfig is Kubeconfig for a test.
func (p *Plane) MustKubeconfig(t testing.TB, user string) string {
	t.Helper()
	path, err := p.Kubeconfig(user)
	if err != nil {
		t.Fatal(err)
	}
	return path
}

// PIDs returns the process ids of the plane's processes still running.
func (p *Plane) PIDs() []int {
	var pids []int
	for _, pr := range p.procs {
		if !pr.exited() {
			pids = append(pids, pr.cmd.Process.Pid)
		}
	}
	return pids
}

// PID returns the process id of "etcd", "kube-apiserver" or
// "kube-scheduler" (0 when it is not running).
func (p *Plane) PID(name string) int {
	for _, pr := range p.procs {
		if pr.name == name && !pr.exited() {
			return pr.cmd.Process.Pid
		}
	}
	return 0
}

// Stop ends the processes, the scheduler first, and waits for them. It can
// be called more than once.
func (p *Plane) Stop() {
	for i := len(p.procs) - 1; i >= 0; i-- {
		p.procs[i].stop()
	}
}

func (p *Plane) dumpLogs(t testing.TB) {
	for _, pr := range p.procs {
		data, _ := os.ReadFile(pr.logFile)
		if len(data) > 8000 {
			data = data[len(data)-8000:]
		}
		t.Logf("--- %s (last of %s)\n%s", pr.name, pr.logFile, data)
	}
}

func randHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// freePort returns a TCP port free on ip now.
func freePort(ip string) string {
	addr, err := freeport.Addr(ip)
	if err != nil {
		return "0"
	}
	_, port, _ := net.SplitHostPort(addr)
	return port
}

func firstLine(b []byte) string {
	s, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	return s
}

var errExited = errors.New("exited")

// waitFor polls check until it succeeds, the process exits or limit passes.
func waitFor(limit time.Duration, pr *proc, check func() error) error {
	deadline := time.Now().Add(limit)
	for {
		err := check()
		if err == nil {
			return nil
		}
		if pr.exited() {
			return fmt.Errorf("%s %w: %s", pr.name, errExited, pr.tail())
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %s: %v", pr.name, limit, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
