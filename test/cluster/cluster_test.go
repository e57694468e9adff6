// Package cluster runs three cage nodes as one cluster on this machine
// (clusterutil: a real control plane, a network namespace per node) and
// meets it as its users do: the real E2B SDK through two different
// fronts, sandboxes landing on every node, a microvm create landing only
// where the wall is, a node killed with SIGKILL (its sandboxes reported
// lost, creates going on elsewhere), the node back (nothing unaccounted
// for), and a node cut off from the API server.
package cluster

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/client"
	"github.com/cagehq/cage/internal/cluster"
	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/test/cluster/clusterutil"
)

func TestMain(m *testing.M) { os.Exit(testutil.InOwnNetwork(m)) }

// placements records the node of every sandbox pod the scheduler binds.
type placements struct {
	mu sync.Mutex
	at map[string]string // sandbox id -> node
}

// count is how many sandbox pods have been bound so far.
func (p *placements) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.at)
}

// node is where sandbox id was placed, waiting a little for the watch to
// tell ("" when it never does).
func (p *placements) node(id string) string {
	for end := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		p.mu.Lock()
		n := p.at[id]
		p.mu.Unlock()
		if n != "" || time.Now().After(end) {
			return n
		}
	}
}

func watchPlacements(t *testing.T, c *clusterutil.Cluster) *placements {
	p := &placements{at: map[string]string{}}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	w, err := c.Admin.CoreV1().Pods(clusterutil.Namespace).Watch(ctx, metav1.ListOptions{LabelSelector: cluster.LabelSandbox + "=true"})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for ev := range w.ResultChan() {
			if pod, ok := ev.Object.(*corev1.Pod); ok && ev.Type != watch.Error && pod.Spec.NodeName != "" {
				p.mu.Lock()
				p.at[pod.Name] = pod.Spec.NodeName
				p.mu.Unlock()
			}
		}
	}()
	return p
}

func TestCluster(t *testing.T) {
	requireNode(t)
	sdk := sdkDir(t)
	microvm := microvmHere()
	walls := []string{"process"}
	cWalls := walls
	if microvm {
		cWalls = append([]string{"microvm"}, walls...)
	}
	pool := map[string]any{"pool": 1, "pool_template": "host"}
	cPool := pool
	runc := runcHere()
	if runc {
		// C also keeps a prepared runc sandbox of base: a runc create
		// lands there and claims it (the answer's id is the prepared
		// sandbox's, not the claim pod's).
		cWalls = append(cWalls, "runc")
		cPool = map[string]any{"pool": 1, "pool_template": "host", "pools": map[string]int{"runc/base": 1}}
	}
	c := clusterutil.Start(t, clusterutil.Options{Nodes: []clusterutil.NodeOptions{
		{Name: "a", Walls: walls, Config: pool}, {Name: "b", Walls: walls, Config: pool},
		{Name: "c", Walls: cWalls, Config: cPool}}})
	defer func() {
		if t.Failed() {
			for _, n := range c.Nodes {
				t.Logf("=== node %s's log:\n%s", n.Name, tail(n.Log(), 60))
			}
		}
	}()
	where := watchPlacements(t, c)

	for _, front := range []string{"a", "c"} {
		t.Run("sdk through "+front, func(t *testing.T) {
			ids := runSDK(t, sdk, c, front)
			nodes := map[string]int{}
			for _, id := range ids {
				nodes[where.node(id)]++
			}
			if len(ids) == 0 || nodes["a"] == 0 || nodes["b"] == 0 || nodes["c"] == 0 {
				t.Errorf("the SDK's sandboxes landed on %v, want every node", nodes)
			}
		})
	}
	if t.Failed() {
		return
	}

	t.Run("walls", func(t *testing.T) {
		if runc {
			before := where.count()
			id := create(t, c, "a", `{"templateID":"base","wall":"runc","timeout":120}`)
			if n := where.node(id); n != "c" {
				t.Errorf("runc sandbox %s on node %q, want c (the only runc node)", id, n)
			}
			// Two new pods (the claim, deleted, and the prepared
			// sandbox's) when C's pool had one ready; one otherwise.
			t.Logf("runc create: %d new pods (2: a prepared sandbox was claimed)", where.count()-before)
			if code, body := call(t, c, "b", "GET", "/sandboxes/"+id, c.Key, ""); code != 200 {
				t.Errorf("the pooled runc sandbox through b: %d %s", code, body)
			}
			kill(t, c, "b", id)
		}
		if !microvm {
			// No node offers it: a clear 503 from any front.
			code, body := call(t, c, "a", "POST", "/sandboxes", c.Key, `{"templateID":"base","wall":"microvm"}`)
			if code != 503 || !strings.Contains(body, "no node of the cluster can run wall microvm") {
				t.Fatalf("microvm create with no microvm node: %d %s", code, body)
			}
			t.Log("microvm is not available here: checked the refusal only")
			return
		}
		for i := 0; i < 2; i++ {
			id := create(t, c, "a", `{"templateID":"base","wall":"microvm","timeout":120}`)
			if n := where.node(id); n != "c" {
				t.Errorf("microvm sandbox %s on node %q, want c (the only microvm node)", id, n)
			}
			kill(t, c, "a", id)
		}
	})

	t.Run("tenants and keys", func(t *testing.T) { tenants(t, c, where) })
	t.Run("node signatures stay out of sandboxes", func(t *testing.T) { nodeSignature(t, c, where) })
	t.Run("lost node, then back", func(t *testing.T) { lostAndBack(t, c, where) })
	t.Run("partition", func(t *testing.T) { partition(t, c, where) })
}

// tenants: another key of the cluster sees nothing of a sandbox on
// another node through any front (the same 404 as for no sandbox, and
// nothing is forwarded); traffic forwarded to the owner still needs the
// sandbox's token; a key revoked in the cluster stops working on every
// node.
func tenants(t *testing.T, c *clusterutil.Cluster, where *placements) {
	other := c.NewKey(t, "other-tenant")
	id := onNode(t, c, where, "b", 1)[0]
	defer kill(t, c, "a", id)
	for _, front := range []string{"a", "c"} {
		for _, m := range []string{"GET", "DELETE"} {
			if code, body := call(t, c, front, m, "/sandboxes/"+id, other, ""); code != 404 {
				t.Errorf("another tenant's %s of a sandbox on b through %s: %d %s, want 404", m, front, code, body)
			}
		}
		if code, body := call(t, c, front, "POST", "/sandboxes/"+id+"/timeout", other, `{"timeout":5}`); code != 404 {
			t.Errorf("another tenant's timeout through %s: %d %s, want 404", front, code, body)
		}
	}
	if code, _ := call(t, c, "a", "GET", "/sandboxes/"+id, c.Key, ""); code != 200 {
		t.Fatalf("the owner's get after the other's attempts: %d", code)
	}
	// A fork would have no pod: refused, and nothing is made.
	if code, body := call(t, c, "a", "POST", "/sandboxes/"+id+"/fork", c.Key, `{}`); code != 409 ||
		!strings.Contains(body, "not available in cluster mode") {
		t.Errorf("fork in cluster mode: %d %s, want 409", code, body)
	}
	// Through A's proxy to b's sandbox, without its access token: b's
	// proxy refuses it (401), as it would a request made to it.
	req, _ := http.NewRequest("POST", c.Nodes["a"].Proxy+"/process.Process/List", strings.NewReader("{}"))
	req.Header.Set("E2b-Sandbox-Id", id)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("traffic without the access token, forwarded to b: %d, want 401", resp.StatusCode)
	}
	if out, err := c.Cage("keys", "revoke", other[:12]); err != nil {
		t.Fatalf("cage keys revoke --kubeconfig: %v %s", err, out)
	}
	for _, n := range []string{"a", "b", "c"} {
		waitFor(t, 20*time.Second, "the revoked key refused on "+n, func() bool {
			code, _ := call(t, c, n, "GET", "/v2/sandboxes", other, "")
			return code == 401
		})
	}
}

// echoHeaders is a server for a sandbox's port 8080 that answers each
// request with its headers as JSON.
const echoHeaders = `
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def answer(self):
        b = json.dumps(dict(self.headers.items())).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    do_GET = do_POST = answer
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", 8080), H).serve_forever()
`

// nodeSignature: traffic a front forwards to the sandbox's node is signed
// by the front, and the sandbox never sees that signature: a tenant's own
// server, which echoes the headers of what reaches it, shows none for a
// request made through another node's proxy, whatever path it names.
// (A signature seen there, for the path of the internal start route, once
// opened another tenant's sandbox record to a replay; signatures are now
// also bound to their purpose and node, which internal/cluster's tests
// check.) Nothing the sandbox sees opens the internal routes either.
func nodeSignature(t *testing.T, c *clusterutil.Cluster, where *placements) {
	var id, token string
	// The sandboxes that land elsewhere stay until one lands on b: the
	// scheduler prefers the least allocated node, and a node that had
	// each one killed at once would stay that.
	var elsewhere []string
	defer func() {
		for _, other := range elsewhere {
			kill(t, c, "a", other)
		}
	}()
	for i := 0; i < 12 && id == ""; i++ {
		code, out := call(t, c, "a", "POST", "/sandboxes", c.Key, `{"templateID":"host","timeout":300}`)
		var sb struct {
			SandboxID       string `json:"sandboxID"`
			EnvdAccessToken string `json:"envdAccessToken"`
		}
		if code != 201 || json.Unmarshal([]byte(out), &sb) != nil {
			t.Fatalf("create: %d %s", code, out)
		}
		if where.node(sb.SandboxID) == "b" {
			id, token = sb.SandboxID, sb.EnvdAccessToken
		} else {
			elsewhere = append(elsewhere, sb.SandboxID)
		}
	}
	if id == "" {
		t.Fatal("no create landed on b")
	}
	defer kill(t, c, "a", id)
	ag, err := client.New("", c.Nodes["b"].Proxy, "").Agent(id, token)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_, _ = ag.Run(ctx, agentclient.RunOptions{Cmd: "python3", Args: []string{"-c", echoHeaders}, Stdout: io.Discard, Stderr: io.Discard})
	}()
	through := func(front, path string) (int, map[string]string) {
		req, _ := http.NewRequest("POST", c.Nodes[front].Proxy+path, nil)
		req.Header.Set("E2b-Sandbox-Id", id)
		req.Header.Set("E2b-Sandbox-Port", "8080")
		resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
		if err != nil {
			return 0, nil
		}
		defer resp.Body.Close()
		var seen map[string]string
		_ = json.NewDecoder(resp.Body).Decode(&seen)
		return resp.StatusCode, seen
	}
	waitFor(t, 30*time.Second, "the sandbox's server answering through a's proxy", func() bool {
		code, _ := through("a", "/")
		return code == 200
	})
	start := "/cluster/pods/" + id + "/start"
	for _, front := range []string{"a", "c"} {
		code, seen := through(front, start)
		if code != 200 || seen == nil {
			t.Fatalf("through %s's proxy to b's sandbox: %d %v", front, code, seen)
		}
		for k, v := range seen {
			if strings.EqualFold(k, cluster.AuthHeader) {
				t.Errorf("through %s's proxy, the sandbox saw %s: %s", front, k, v)
				for _, n := range []string{"a", "b", "c"} {
					if code, body := call(t, c, n, "POST", start, "", "", cluster.AuthHeader, v); code != 401 {
						t.Errorf("that signature replayed to %s's %s: %d %.200s", n, start, code, body)
					}
				}
			}
		}
	}
}

// lostAndBack: B's cage serve is killed with SIGKILL. Its sandboxes are
// 503 "lost" through the other fronts, left out of lists, and a kill of
// one deletes its pod; creates land on A and C. B comes back: the
// sandbox whose pod remains is served again, the killed one's processes
// are gone, and no sandbox runs without a pod.
func lostAndBack(t *testing.T, c *clusterutil.Cluster, where *placements) {
	onB := onNode(t, c, where, "b", 2)
	b := c.Nodes["b"]
	b.Kill9()
	lostMsg := "is on node b, which is lost (lease expired at "
	waitFor(t, 30*time.Second, "b's sandbox reported lost", func() bool {
		code, body := call(t, c, "a", "GET", "/sandboxes/"+onB[0], c.Key, "")
		return code == 503 && strings.Contains(body, lostMsg)
	})
	if code, body := call(t, c, "c", "GET", "/sandboxes/"+onB[0], c.Key, ""); code != 503 || !strings.Contains(body, lostMsg) {
		t.Errorf("through c: %d %s", code, body)
	}
	if ids := list(t, c, "a"); contains(ids, onB[0]) {
		t.Errorf("a lost sandbox is listed: %v", ids)
	}
	if code, body := call(t, c, "a", "DELETE", "/sandboxes/"+onB[1], c.Key, ""); code != 204 {
		t.Fatalf("kill of a sandbox on a lost node: %d %s", code, body)
	}
	if procs := sandboxProcs(onB[1]); len(procs) == 0 {
		t.Logf("note: %s's processes were already gone while b was down", onB[1])
	}
	waitFor(t, 30*time.Second, "b tainted unreachable", func() bool {
		n, err := c.Admin.CoreV1().Nodes().Get(context.Background(), "b", metav1.GetOptions{})
		return err == nil && hasTaint(n, cluster.TaintUnreachable)
	})
	for i := 0; i < 3; i++ {
		id := create(t, c, "a", `{"templateID":"host","timeout":60}`)
		if n := where.node(id); n == "b" {
			t.Errorf("a create landed on the lost node b")
		}
		kill(t, c, "c", id)
	}

	if err := b.Start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 60*time.Second, "b's surviving sandbox served again", func() bool {
		code, _ := call(t, c, "a", "GET", "/sandboxes/"+onB[0], c.Key, "")
		return code == 200
	})
	waitFor(t, 30*time.Second, "the killed sandbox's processes gone", func() bool { return len(sandboxProcs(onB[1])) == 0 })
	code, body := call(t, c, "b", "GET", "/sandboxes/"+onB[1], c.Key, "", cluster.AuthHeader, "local")
	if code != 404 {
		t.Errorf("b still has the sandbox killed while it was down: %d %s", code, body)
	}
	waitFor(t, 30*time.Second, "b untainted", func() bool {
		n, err := c.Admin.CoreV1().Nodes().Get(context.Background(), "b", metav1.GetOptions{})
		return err == nil && !hasTaint(n, cluster.TaintUnreachable)
	})
	kill(t, c, "c", onB[0])
	waitFor(t, 30*time.Second, "the last sandbox's processes gone", func() bool { return len(sandboxProcs(onB[0])) == 0 })
}

// partition: B cut off from the bridge (the API server and the other
// nodes) is lost to the fronts as a dead node is; healed, its sandbox is
// served again.
func partition(t *testing.T, c *clusterutil.Cluster, where *placements) {
	onB := onNode(t, c, where, "b", 1)
	if err := c.Partition("b", true); err != nil {
		t.Fatal(err)
	}
	healed := false
	defer func() {
		if !healed {
			_ = c.Partition("b", false)
		}
	}()
	waitFor(t, 30*time.Second, "b's sandbox reported lost", func() bool {
		code, body := call(t, c, "a", "GET", "/sandboxes/"+onB[0], c.Key, "")
		return code == 503 && strings.Contains(body, "is on node b, which is lost")
	})
	if err := c.Partition("b", false); err != nil {
		t.Fatal(err)
	}
	healed = true
	waitFor(t, 60*time.Second, "b's sandbox served again after the partition", func() bool {
		code, _ := call(t, c, "a", "GET", "/sandboxes/"+onB[0], c.Key, "")
		return code == 200
	})
	kill(t, c, "a", onB[0])
}

// onNode creates sandboxes through A, keeping them, until n of them are
// on node (kube-scheduler prefers the emptiest node: each create makes the
// others fuller); the others are then killed.
func onNode(t *testing.T, c *clusterutil.Cluster, where *placements, node string, n int) []string {
	var ids, others []string
	for i := 0; len(ids) < n && i < 3*n+3; i++ {
		id := create(t, c, "a", `{"templateID":"host","timeout":300}`)
		if where.node(id) == node {
			ids = append(ids, id)
		} else {
			others = append(others, id)
		}
	}
	for _, id := range others {
		kill(t, c, "a", id)
	}
	if len(ids) < n {
		t.Fatalf("no %d sandboxes landed on %s", n, node)
	}
	return ids
}

func hasTaint(n *corev1.Node, key string) bool {
	for _, t := range n.Spec.Taints {
		if t.Key == key {
			return true
		}
	}
	return false
}

func call(t *testing.T, c *clusterutil.Cluster, front, method, path, key, body string, hdr ...string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, c.Nodes[front].API+path, strings.NewReader(body))
	req.Header.Set("X-API-Key", key)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := (&http.Client{Timeout: 2 * time.Minute}).Do(req)
	if err != nil {
		t.Fatalf("%s %s through %s: %v", method, path, front, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func create(t *testing.T, c *clusterutil.Cluster, front, body string) string {
	t.Helper()
	code, out := call(t, c, front, "POST", "/sandboxes", c.Key, body)
	var sb struct {
		SandboxID string `json:"sandboxID"`
	}
	if code != 201 || json.Unmarshal([]byte(out), &sb) != nil || sb.SandboxID == "" {
		t.Fatalf("create through %s: %d %s", front, code, out)
	}
	return sb.SandboxID
}

func kill(t *testing.T, c *clusterutil.Cluster, front, id string) {
	t.Helper()
	if code, out := call(t, c, front, "DELETE", "/sandboxes/"+id, c.Key, ""); code != 204 {
		t.Errorf("kill %s through %s: %d %s", id, front, code, out)
	}
}

func list(t *testing.T, c *clusterutil.Cluster, front string) []string {
	t.Helper()
	code, out := call(t, c, front, "GET", "/v2/sandboxes", c.Key, "")
	var items []struct {
		SandboxID string `json:"sandboxID"`
	}
	if code != 200 || json.Unmarshal([]byte(out), &items) != nil {
		t.Fatalf("list through %s: %d %s", front, code, out)
	}
	var ids []string
	for _, it := range items {
		ids = append(ids, it.SandboxID)
	}
	return ids
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// sandboxProcs are the processes of sandbox id.
func sandboxProcs(id string) []int { return clusterutil.SandboxProcs(id) }

func waitFor(t *testing.T, limit time.Duration, what string, ok func() bool) {
	t.Helper()
	for end := time.Now().Add(limit); !ok(); time.Sleep(200 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("no %s within %s", what, limit)
		}
	}
}

// runSDK runs cluster.test.mjs with the SDK pointed at front's API and
// proxy, and returns the ids of the sandboxes it made.
func runSDK(t *testing.T, sdk string, c *clusterutil.Cluster, front string) []string {
	n := c.Nodes[front]
	env := []string{}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "E2B_") && !strings.HasPrefix(kv, "CAGE_") {
			env = append(env, kv)
		}
	}
	env = append(env, "E2B_API_URL="+n.API, "E2B_SANDBOX_URL="+n.Proxy, "E2B_API_KEY="+c.Key, "E2B_DIR="+sdk,
		"CLUSTER_RUN=run-"+front, "CLUSTER_SANDBOXES=4", "CAGE_TEST_TEMPLATE=host",
		"NO_PROXY=10.197.0.0/16", "no_proxy=10.197.0.0/16")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", "--test", "--test-reporter=spec", "cluster.test.mjs")
	cmd.Dir, cmd.Env, cmd.WaitDelay = filepath.Join(testutil.RepoRoot(), "test", "cluster"), env, 5*time.Second
	out, err := cmd.CombinedOutput()
	var ids []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		t.Log(line)
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "# sandboxes "); ok {
			_ = json.Unmarshal([]byte(rest), &ids)
		}
	}
	if err != nil {
		t.Errorf("the E2B SDK through %s failed: %v", front, err)
	}
	return ids
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// requireNode skips unless node runs (fails where scripts/test.sh ran:
// CAGE_REQUIRE_E2B=1).
func requireNode(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("node"); err != nil {
		if os.Getenv("CAGE_REQUIRE_E2B") == "1" {
			t.Fatalf("node is required here: %v", err)
		}
		t.Skipf("SKIP: needs node on PATH to run the E2B SDK: %v", err)
	}
}

// sdkDir is test/e2b, whose node_modules (npm ci by scripts/test.sh) holds
// the SDK.
func sdkDir(t *testing.T) string {
	dir := filepath.Join(testutil.RepoRoot(), "test", "e2b")
	var want strings.Builder
	for _, name := range []string{"package.json", "package-lock.json"} {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&want, "%x  %s\n", sha256.Sum256(b), name)
	}
	got, _ := os.ReadFile(filepath.Join(dir, "node_modules", ".cage-lock-sha256"))
	if string(got) != want.String() {
		t.Fatalf("test/e2b/node_modules is missing or older than package-lock.json: run scripts/test.sh (it runs npm ci there)")
	}
	return dir
}

// runcHere says whether this machine runs the runc wall with base.
func runcHere() bool {
	_, err := exec.LookPath("runc")
	_, berr := os.Stat(filepath.Join(os.Getenv("CAGE_TEMPLATES"), "templates", "base.json"))
	return err == nil && os.Getenv("CAGE_TEMPLATES") != "" && berr == nil
}

// microvmHere says whether this machine runs the microvm wall (QEMU, the
// guest kernel and the base template).
func microvmHere() bool {
	_, qerr := exec.LookPath("qemu-system-x86_64")
	_, kerr := os.Stat(filepath.Join(testutil.KernelDir(), "current"))
	tpl := os.Getenv("CAGE_TEMPLATES")
	_, berr := os.Stat(filepath.Join(tpl, "templates", "base.json"))
	return qerr == nil && kerr == nil && tpl != "" && berr == nil
}
