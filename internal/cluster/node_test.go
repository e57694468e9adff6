package cluster_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/cluster"
	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/kube"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/testutil/cageserve"
	"github.com/cagehq/cage/internal/testutil/kubeplane"
)

const nodeName = "node-w"

// nodeEnv is one cage serve joined, as node nodeName, to a real control
// plane on loopback, and the plane's administrator.
type nodeEnv struct {
	d     *cageserve.Daemon
	admin *kube.Client
	owner string // the owner (key id) of d.Key's sandboxes
	link  *link  // the node's way to the API server
	plane *kubeplane.Plane
	// runcPool: the node keeps a runc pool of base (CAGE_TEMPLATES is set)
	runcPool bool
	dify     string // the Dify listener's address (with the template store)
}

const difyKey = "dify-node-test-key-1"

func startNode(t *testing.T) *nodeEnv {
	t.Helper()
	p := kubeplane.Start(t, kubeplane.Options{Nodes: []string{nodeName}})
	akc, err := kube.LoadKubeconfig(p.MustKubeconfig(t, kubeplane.Admin))
	if err != nil {
		t.Fatal(err)
	}
	admin, err := kube.New(akc, kube.Options{QPS: 500, Burst: 1000})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := cluster.ApplyRBAC(ctx, admin); err != nil {
		t.Fatalf("ApplyRBAC: %v", err)
	}
	conf := filepath.Join(t.TempDir(), "cage.json")
	cfg := map[string]any{"cluster": map[string]any{"lease_seconds": 6}}
	// With the template store (base), a runc pool: a claim takes pooled
	// sandboxes on the walls whose pools pay (not process).
	templates := os.Getenv("CAGE_TEMPLATES")
	pools := "0"
	if templates != "" {
		cfg["templates"], cfg["pools"], pools = templates, map[string]int{"runc/base": 1}, "1"
		cfg["dify"] = map[string]any{"key": difyKey}
	}
	b, _ := json.Marshal(cfg)
	if err := os.WriteFile(conf, b, 0o600); err != nil {
		t.Fatal(err)
	}
	// The node reaches the API server through a link the test can cut.
	l := newLink(t, strings.TrimPrefix(p.URL, "https://"))
	kc := p.MustKubeconfig(t, kubeplane.NodeUser(nodeName))
	kb, err := os.ReadFile(kc)
	if err != nil {
		t.Fatal(err)
	}
	kc = filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kc, []byte(strings.Replace(string(kb), p.URL, "https://"+l.addr, 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	flags := []string{}
	difyAddr := ""
	if templates != "" {
		difyAddr = cageserve.FreePort(t)
		flags = append(flags, "--dify", difyAddr)
	}
	d := cageserve.Start(t, append(flags, "--kubeconfig", kc,
		"--node-name", nodeName, "--advertise", "127.0.0.1", "--config", conf)...)
	out, _, err := d.Cage("keys", "ls", "--data", d.Data, "--json")
	var keys []struct {
		ID string `json:"id"`
	}
	if err != nil || json.Unmarshal(out, &keys) != nil || len(keys) == 0 {
		t.Fatalf("cage keys ls: %v: %s", err, out)
	}
	return &nodeEnv{d: d, admin: admin, owner: keys[0].ID, link: l, plane: p, runcPool: pools == "1", dify: difyAddr}
}

// TestNode runs one node against a real control plane: registration, the
// lease, pods become sandboxes and back, the internal route's
// authentication, and a restart with pods deleted while the node was down.
func TestNode(t *testing.T) {
	e := startNode(t)
	t.Run("Registered", e.testRegistered)
	t.Run("PodBecomesSandbox", e.testPodBecomesSandbox)
	t.Run("KillDeletesPod", e.testKillDeletesPod)
	t.Run("PauseState", e.testPauseState)
	t.Run("TimeoutWritesBounded", e.testTimeoutWrites)
	t.Run("CreateThroughAPI", e.testCreateThroughAPI)
	t.Run("DifyGetsPods", e.testDifyGetsPods)
	t.Run("PooledClaim", e.testPooledClaim)
	t.Run("MalformedSpec", e.testMalformed)
	t.Run("StartNeedsNodeAuth", e.testStartAuth)
	t.Run("Partition", e.testPartition)
	t.Run("Restart", e.testRestart)
}

func (e *nodeEnv) testRegistered(t *testing.T) {
	ctx := context.Background()
	n, err := e.admin.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{cluster.NodeLabel: "true", cluster.WallLabelPrefix + "process": "true",
		"kubernetes.io/hostname": nodeName} {
		if n.Labels[k] != v {
			t.Errorf("label %s = %q, want %q", k, n.Labels[k], v)
		}
	}
	if n.Annotations[cluster.AnnoAPI] != "http://"+e.d.API || n.Annotations[cluster.AnnoProxy] != "http://"+e.d.Proxy {
		t.Errorf("annotations %v; API %s proxy %s", n.Annotations, e.d.API, e.d.Proxy)
	}
	tainted := false
	for _, tn := range n.Spec.Taints {
		tainted = tainted || tn.Key == cluster.Taint && tn.Value == "true" && tn.Effect == corev1.TaintEffectNoSchedule
	}
	if !tainted {
		t.Errorf("taints %v", n.Spec.Taints)
	}
	c := n.Status.Capacity
	if c.Cpu().MilliValue() != int64(runtime.NumCPU())*cluster.DefaultCPUOvercommit*1000 ||
		c.Memory().Value() < 64<<20*cluster.DefaultMemoryOvercommit || c.Pods().Value() < 16 {
		t.Errorf("capacity %v", c)
	}
	ready := false
	for _, cd := range n.Status.Conditions {
		ready = ready || cd.Type == corev1.NodeReady && cd.Status == corev1.ConditionTrue
	}
	if !ready || len(n.Status.Addresses) == 0 || n.Status.Addresses[0].Address != "127.0.0.1" {
		t.Errorf("status %+v", n.Status)
	}
	t.Logf("node labels: %v", n.Labels)
	// A node that runs microvm says how (kvm or tcg) once its probe has.
	if n.Labels[cluster.WallLabelPrefix+"microvm"] == "true" {
		waitFor(t, 20*time.Second, "the microvm-accel label", func() bool {
			n, err := e.admin.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
			v := n.Labels[cluster.LabelMicrovmAccel]
			return err == nil && (v == "kvm" || v == "tcg")
		})
	} else if _, ok := n.Labels[cluster.LabelMicrovmAccel]; ok {
		t.Errorf("a microvm-accel label without the microvm wall")
	}
	// The lease is renewed every 1.5 s (6 s / 4).
	l1, err := e.admin.CoordinationV1().Leases(cluster.NodeLeaseNamespace).Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if *l1.Spec.HolderIdentity != nodeName || *l1.Spec.LeaseDurationSeconds != 6 {
		t.Errorf("lease %+v", l1.Spec)
	}
	waitFor(t, 10*time.Second, "the lease renewed", func() bool {
		l2, err := e.admin.CoordinationV1().Leases(cluster.NodeLeaseNamespace).Get(ctx, nodeName, metav1.GetOptions{})
		return err == nil && l2.Spec.RenewTime.After(l1.Spec.RenewTime.Time)
	})
}

// newPod creates a sandbox pod bound to the node, as the scheduler would.
func (e *nodeEnv) newPod(t *testing.T, mutate func(*corev1.Pod)) string {
	t.Helper()
	return e.newPodOn(t, "process", "host", mutate)
}

func (e *nodeEnv) newPodOn(t *testing.T, wall, template string, mutate func(*corev1.Pod)) string {
	t.Helper()
	id := ids.NewID()
	pod, err := cluster.PodFor(id, manager.CreateRequest{Wall: wall, Template: template, KeyID: e.owner,
		Timeout: 10 * time.Minute}, cluster.DefaultNamespace)
	if err != nil {
		t.Fatal(err)
	}
	pod.Spec.NodeName = nodeName
	if mutate != nil {
		mutate(pod)
	}
	if _, err := e.admin.CoreV1().Pods(cluster.DefaultNamespace).Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		zero := int64(0)
		_ = e.admin.CoreV1().Pods(cluster.DefaultNamespace).Delete(context.Background(), id, metav1.DeleteOptions{GracePeriodSeconds: &zero})
		e.d.Kill(e.d.Key, id)
	})
	return id
}

func (e *nodeEnv) pod(id string) (*corev1.Pod, error) {
	return e.admin.CoreV1().Pods(cluster.DefaultNamespace).Get(context.Background(), id, metav1.GetOptions{})
}

// running waits for pod id to be Running and returns it.
func (e *nodeEnv) running(t *testing.T, id string) *corev1.Pod {
	t.Helper()
	var p *corev1.Pod
	waitFor(t, 30*time.Second, "pod "+id+" Running", func() bool {
		var err error
		p, err = e.pod(id)
		return err == nil && p.Status.Phase == corev1.PodRunning
	})
	return p
}

func (e *nodeEnv) gone(t *testing.T, id string) {
	t.Helper()
	waitFor(t, 30*time.Second, "pod "+id+" deleted", func() bool {
		_, err := e.pod(id)
		return kube.IsNotFound(err)
	})
}

func (e *nodeEnv) noAgent(t *testing.T, id string) {
	t.Helper()
	waitFor(t, 10*time.Second, "no process of sandbox "+id, func() bool {
		_, err := cageserve.AgentPID(id)
		return err != nil
	})
}

// detail is GET /sandboxes/{id} on the node's API.
func (e *nodeEnv) detail(t *testing.T, id string) (types.SandboxDetail, int) {
	t.Helper()
	status, body, err := e.d.Do(http.MethodGet, "/sandboxes/"+id, e.d.Key, nil)
	if err != nil {
		t.Fatal(err)
	}
	var sd types.SandboxDetail
	if status == http.StatusOK {
		if err := json.Unmarshal(body, &sd); err != nil {
			t.Fatal(err)
		}
	}
	return sd, status
}

func (e *nodeEnv) testPodBecomesSandbox(t *testing.T) {
	id := e.newPod(t, nil)
	p := e.running(t, id)
	if p.Status.PodIP == "" || p.Status.HostIP != "127.0.0.1" || p.Annotations[cluster.AnnoState] != "running" {
		t.Errorf("status %+v annotations %v", p.Status, p.Annotations)
	}
	if end := cluster.EndOf(p); time.Until(end) < 9*time.Minute || time.Until(end) > 11*time.Minute {
		t.Errorf("end annotation %q", p.Annotations[cluster.AnnoEnd])
	}
	ready := 0
	for _, c := range p.Status.Conditions {
		if c.Status == corev1.ConditionTrue {
			ready++
		}
	}
	if ready != 4 || len(p.Status.ContainerStatuses) != 1 || p.Status.ContainerStatuses[0].State.Running == nil {
		t.Errorf("conditions %+v containers %+v", p.Status.Conditions, p.Status.ContainerStatuses)
	}
	sd, status := e.detail(t, id)
	if status != http.StatusOK {
		t.Fatalf("GET /sandboxes/%s: %d", id, status)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := e.d.Agent(id, sd.EnvdAccessToken)
	defer c.Close()
	var out strings.Builder
	end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", "echo from-$((6*7))"}, Stdout: &out})
	if err != nil || end.ExitCode != 0 || strings.TrimSpace(out.String()) != "from-42" {
		t.Fatalf("run in the sandbox: %v %+v %q", err, end, out.String())
	}
	// A timeout change moves the end annotation.
	if status, body, err := e.d.Do(http.MethodPost, "/sandboxes/"+id+"/timeout", e.d.Key, map[string]any{"timeout": 3600}); err != nil || status != http.StatusNoContent {
		t.Fatalf("set timeout: %d %s %v", status, body, err)
	}
	waitFor(t, 10*time.Second, "the end annotation moved", func() bool {
		p, err := e.pod(id)
		return err == nil && time.Until(cluster.EndOf(p)) > 50*time.Minute
	})
	// Deleting the pod (gracefully, as kubectl does) destroys the sandbox,
	// and the node confirms the deletion.
	if err := e.admin.CoreV1().Pods(cluster.DefaultNamespace).Delete(ctx, id, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	e.gone(t, id)
	e.noAgent(t, id)
	if _, status := e.detail(t, id); status != http.StatusNotFound {
		t.Errorf("GET after the pod's deletion: %d", status)
	}
}

// testCreateThroughAPI: an E2B create on the node's API becomes a pod that
// kube-scheduler binds to the node, which starts it for the front.
func (e *nodeEnv) testCreateThroughAPI(t *testing.T) {
	sb := e.d.Create(t, e.d.Key, map[string]any{"templateID": "host", "timeout": 120})
	p := e.running(t, sb.SandboxID)
	if p.Spec.NodeName != nodeName || p.Labels[cluster.LabelKey] != e.owner {
		t.Errorf("pod: node %q labels %v", p.Spec.NodeName, p.Labels)
	}
	c := e.d.Agent(sb.SandboxID, sb.EnvdAccessToken)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/true"}); err != nil || end.ExitCode != 0 {
		t.Fatalf("run: %v %+v", err, end)
	}
	e.d.Kill(e.d.Key, sb.SandboxID)
	e.gone(t, sb.SandboxID)
}

// testTimeoutWrites: attack: a tenant's timeout calls on its sandbox
// fill the cluster's etcd. Each change of the sandbox's end was a write of
// its whole pod (spec included), which etcd keeps until the API server
// compacts: 300 calls were 42 writes, 8 MB of history with a large spec
// (a review, 2026-12-04). Expected: the pod takes a change of its end
// alone at most once per 5 s, and ends with the latest one.
func (e *nodeEnv) testTimeoutWrites(t *testing.T) {
	const every = 5 * time.Second // cluster's endEvery
	sb := e.d.Create(t, e.d.Key, map[string]any{"templateID": "host", "timeout": 120})
	id := sb.SandboxID
	defer e.d.Kill(e.d.Key, id)
	var p *corev1.Pod
	waitFor(t, 30*time.Second, "pod "+id+" Running with its end", func() bool {
		var err error
		p, err = e.pod(id)
		return err == nil && p.Status.Phase == corev1.PodRunning && p.Annotations[cluster.AnnoEnd] != ""
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, err := e.admin.CoreV1().Pods(cluster.DefaultNamespace).Watch(ctx, metav1.ListOptions{
		FieldSelector: "metadata.name=" + id, ResourceVersion: p.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	start := time.Now()
	const calls = 100
	for i := range calls {
		status, body, err := e.d.Do(http.MethodPost, "/sandboxes/"+id+"/timeout", e.d.Key, map[string]any{"timeout": 200 + i})
		if err != nil || status != http.StatusNoContent {
			t.Fatalf("timeout: %d %s %v", status, body, err)
		}
	}
	took := time.Since(start)
	last := time.Now().Add((200 + calls - 1) * time.Second)
	writes := 0
	var end time.Time
	for quiet := time.After(took + 3*every); ; {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				t.Fatalf("the watch ended: %v", w.Err())
			}
			if pod, isPod := ev.Object.(*corev1.Pod); isPod && ev.Type == kube.Modified {
				writes++
				end = cluster.EndOf(pod)
			}
			continue
		case <-quiet:
		}
		break
	}
	if most := 2 + int(took/every); writes > most {
		t.Errorf("%d timeout calls in %v were %d writes of the pod, want at most %d", calls, took.Round(time.Millisecond), writes, most)
	}
	if d := end.Sub(last); d < -3*time.Second || d > 3*time.Second {
		t.Errorf("the pod's end is %v, want the last call's %v", end, last)
	}
}

// testPauseState: pause and resume show in the pod's state annotation,
// and the pod stays (a paused sandbox is a sandbox).
func (e *nodeEnv) testPauseState(t *testing.T) {
	id := e.newPod(t, nil)
	e.running(t, id)
	state := func(want string) {
		t.Helper()
		waitFor(t, 10*time.Second, "state "+want, func() bool {
			p, err := e.pod(id)
			return err == nil && p.Annotations[cluster.AnnoState] == want && p.Status.Phase == corev1.PodRunning
		})
	}
	if status, body, err := e.d.Do(http.MethodPost, "/sandboxes/"+id+"/pause", e.d.Key, map[string]any{}); err != nil || status != http.StatusNoContent {
		t.Fatalf("pause: %d %s %v", status, body, err)
	}
	state("paused")
	if status, body, err := e.d.Do(http.MethodPost, "/sandboxes/"+id+"/resume", e.d.Key, map[string]any{"timeout": 300}); err != nil || status != http.StatusCreated {
		t.Fatalf("resume: %d %s %v", status, body, err)
	}
	state("running")
	p, _ := e.pod(id)
	if end := cluster.EndOf(p); time.Until(end) > 6*time.Minute || time.Until(end) < 4*time.Minute {
		t.Errorf("end after a resume for 300 s: %v", end)
	}
}

func (e *nodeEnv) testKillDeletesPod(t *testing.T) {
	id := e.newPod(t, nil)
	e.running(t, id)
	if status, body, err := e.d.Do(http.MethodDelete, "/sandboxes/"+id, e.d.Key, nil); err != nil || status != http.StatusNoContent {
		t.Fatalf("kill: %d %s %v", status, body, err)
	}
	e.gone(t, id)
	e.noAgent(t, id)
}

// testDifyGetsPods: a sandbox the manager makes on the node without a pod
// (Dify's sandbox API: one per run) gets a pod bound to the node, and is
// not destroyed as a sandbox whose pod went: the run answers, and the pod
// goes with the sandbox.
func (e *nodeEnv) testDifyGetsPods(t *testing.T) {
	if e.dify == "" {
		t.Skip("SKIP: no template store with base (CAGE_TEMPLATES) for Dify's sandboxes")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, err := e.admin.CoreV1().Pods(cluster.DefaultNamespace).Watch(ctx, metav1.ListOptions{LabelSelector: cluster.LabelKey + "=dify"})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	body, _ := json.Marshal(map[string]any{"language": "python3", "code": "print(6*7)"})
	req, _ := http.NewRequest(http.MethodPost, "http://"+e.dify+"/v1/sandbox/run", bytes.NewReader(body))
	req.Header.Set("X-Api-Key", difyKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(out), `"stdout":"42\n"`) {
		t.Fatalf("dify run: %d %s", resp.StatusCode, out)
	}
	added, deleted := "", false
	for ev := range w.ResultChan() {
		p, ok := ev.Object.(*corev1.Pod)
		if !ok {
			continue
		}
		switch ev.Type {
		case kube.Added:
			if p.Spec.NodeName != nodeName {
				t.Errorf("dify's pod %s bound to %q", p.Name, p.Spec.NodeName)
			}
			added = p.Name
		case kube.Deleted:
			deleted = p.Name == added
		}
		if deleted {
			break
		}
	}
	if added == "" || !deleted {
		t.Fatalf("dify's sandbox: pod added %q, deleted %v", added, deleted)
	}
}

// testPooledClaim: a start with pool=1 may give the claim pod a pooled
// sandbox of another id: that sandbox gets its own pod, Running on the
// node, the claim is deleted, and a second start of the claim answers
// the same sandbox.
func (e *nodeEnv) testPooledClaim(t *testing.T) {
	if !e.runcPool {
		t.Skip("SKIP: no template store with base (CAGE_TEMPLATES) for a runc pool")
	}
	start := func(id string) (int, map[string]any) {
		path := "/cluster/pods/" + id + "/start?pool=1"
		req, _ := http.NewRequest(http.MethodPost, "http://"+e.d.API+path, nil)
		req.Header.Set(cluster.AuthHeader, signedFor(t, e, path))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var rec map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&rec)
		return resp.StatusCode, rec
	}
	var claim, got string
	for try := 0; try < 10 && (got == "" || got == claim); try++ {
		if try > 0 {
			time.Sleep(time.Second) // the pool refills
		}
		claim = e.newPodOn(t, "runc", "base", nil)
		status, rec := start(claim)
		if status != http.StatusOK {
			t.Fatalf("start %s: %d %v", claim, status, rec)
		}
		got, _ = rec["ID"].(string)
		t.Cleanup(func() { e.d.Kill(e.d.Key, got) })
	}
	if got == claim {
		t.Fatal("no start took a pooled sandbox in 10 tries")
	}
	// On the process wall a claim is never pooled (a create is faster).
	proc := e.newPod(t, nil)
	if status, rec := start(proc); status != http.StatusOK || rec["ID"] != proc {
		t.Fatalf("process start: %d %v, want the claim's own id %s", status, rec, proc)
	}
	p := e.running(t, got)
	if p.Spec.NodeName != nodeName || p.Labels[cluster.LabelKey] != e.owner {
		t.Errorf("the pooled sandbox's pod: node %q labels %v", p.Spec.NodeName, p.Labels)
	}
	e.gone(t, claim)
	if _, status := e.detail(t, got); status != http.StatusOK {
		t.Errorf("GET the pooled sandbox: %d", status)
	}
	if _, status := e.detail(t, claim); status != http.StatusNotFound {
		t.Errorf("GET the claim's id: %d", status)
	}
}

func (e *nodeEnv) testMalformed(t *testing.T) {
	id := e.newPod(t, func(p *corev1.Pod) { p.Annotations[cluster.AnnoSpec] = `{"v":1,"wall":"process","cpus":"many"}` })
	var p *corev1.Pod
	waitFor(t, 30*time.Second, "pod "+id+" Failed", func() bool {
		var err error
		p, err = e.pod(id)
		return err == nil && p.Status.Phase == corev1.PodFailed
	})
	if p.Status.Reason != cluster.ReasonCreateFailed || p.Status.Message == "" || strings.Contains(p.Status.Message, "\n") ||
		!strings.Contains(p.Status.Message, cluster.AnnoSpec) {
		t.Errorf("reason %q message %q", p.Status.Reason, p.Status.Message)
	}
	if _, err := cageserve.AgentPID(id); err == nil {
		t.Error("a sandbox runs for a malformed pod")
	}
	// A wall the node does not run fails the same way.
	id2 := e.newPod(t, func(p *corev1.Pod) {
		p.Annotations[cluster.AnnoSpec] = strings.Replace(p.Annotations[cluster.AnnoSpec], `"wall":"process"`, `"wall":"nosuchwall"`, 1)
	})
	waitFor(t, 30*time.Second, "pod "+id2+" Failed", func() bool {
		p, err := e.pod(id2)
		return err == nil && p.Status.Phase == corev1.PodFailed && p.Status.Reason == cluster.ReasonCreateFailed
	})
}

// blockingBody is a request body that is never sent: a server that read
// it would wait until the client gives up.
type blockingBody struct{ read chan struct{} }

func (b *blockingBody) Read([]byte) (int, error) {
	close(b.read)
	select {}
}

func (e *nodeEnv) testStartAuth(t *testing.T) {
	id := e.newPod(t, nil)
	target := "http://" + e.d.API + "/cluster/pods/" + id + "/start"
	otherKey := make([]byte, cluster.KeyLen)
	for name, sign := range map[string]func(r *http.Request){
		"no signature": func(r *http.Request) {},
		"other key":    func(r *http.Request) { cluster.Sign(r, otherKey, "node-other", nodeName, cluster.ForInternal) },
		"for traffic": func(r *http.Request) {
			r.Header.Set(cluster.AuthHeader, signedAs(t, e, "/cluster/pods/"+id+"/start", nodeName, cluster.ForTraffic))
		},
		"for the API": func(r *http.Request) {
			r.Header.Set(cluster.AuthHeader, signedAs(t, e, "/cluster/pods/"+id+"/start", nodeName, cluster.ForAPI))
		},
		"for another node": func(r *http.Request) {
			r.Header.Set(cluster.AuthHeader, signedAs(t, e, "/cluster/pods/"+id+"/start", "node-c", cluster.ForInternal))
		},
		"garbage": func(r *http.Request) { r.Header.Set(cluster.AuthHeader, "node=x,t=1,sig=00") },
		"other path": func(r *http.Request) {
			r.Header.Set(cluster.AuthHeader, signedFor(t, e, "/cluster/pods/"+ids.NewID()+"/start"))
		},
		"replayed late": func(r *http.Request) { r.Header.Set(cluster.AuthHeader, "node="+nodeName+",t=1000,sig=00") },
	} {
		pr, pw := io.Pipe()
		defer pw.Close()
		req, _ := http.NewRequest(http.MethodPost, target, pr)
		req.ContentLength = 1 << 20
		sign(req)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		resp, err := http.DefaultClient.Do(req.WithContext(ctx))
		cancel()
		if err != nil {
			t.Errorf("%s: %v (the server waited for the body?)", name, err)
			continue
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("%s: %d %s, want 401", name, resp.StatusCode, b)
		}
	}
	// Nothing was started by them: the pod is still as the watch leaves
	// it (the watch starts it, which is fine), and a good signature gets
	// the record, secrets included.
	req, _ := http.NewRequest(http.MethodPost, target, nil)
	req.Header.Set(cluster.AuthHeader, signedFor(t, e, "/cluster/pods/"+id+"/start"))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	// A signed start of a name that is no sandbox id: 404, nothing asked of
	// the API server.
	bad := "/cluster/pods/..%2f..%2fx/start"
	breq, _ := http.NewRequest(http.MethodPost, "http://"+e.d.API+bad, nil)
	breq.Header.Set(cluster.AuthHeader, signedFor(t, e, bad))
	if bresp, err := http.DefaultClient.Do(breq); err != nil || bresp.StatusCode != http.StatusNotFound {
		t.Errorf("signed start of a malformed name: %v %v", err, bresp)
	} else {
		bresp.Body.Close()
	}
	var rec struct{ ID, AccessToken string }
	if err := json.NewDecoder(resp.Body).Decode(&rec); err != nil || resp.StatusCode != http.StatusOK || rec.ID != id || rec.AccessToken == "" {
		t.Fatalf("signed start: %d %+v %v", resp.StatusCode, rec, err)
	}
}

// signedFor is the AuthHeader another node would send for POST path, made
// with the cluster's node key read from its Secret.
func signedFor(t *testing.T, e *nodeEnv, path string) string {
	t.Helper()
	return signedAs(t, e, path, nodeName, cluster.ForInternal)
}

// signedAs is a signature of POST path by another node for node to and
// purpose p.
func signedAs(t *testing.T, e *nodeEnv, path, to string, p cluster.Purpose) string {
	t.Helper()
	s, err := e.admin.CoreV1().Secrets(cluster.DefaultNamespace).Get(context.Background(), cluster.KeySecret, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	r, _ := http.NewRequest(http.MethodPost, "http://x"+path, nil)
	cluster.Sign(r, s.Data[cluster.KeySecretData], "node-other", to, p)
	return r.Header.Get(cluster.AuthHeader)
}

// testRestart stops the node, and while it is down deletes one pod
// gracefully (it stays, marked for deletion: no kubelet confirms it),
// removes another at once, and kills the third sandbox's processes. At
// the next start the first two sandboxes are destroyed and their pods
// gone; the third pod is reported Lost.
func (e *nodeEnv) testRestart(t *testing.T) {
	graceful, forced, lost := e.newPod(t, nil), e.newPod(t, nil), e.newPod(t, nil)
	for _, id := range []string{graceful, forced, lost} {
		e.running(t, id)
	}
	agent, err := cageserve.AgentPID(lost)
	if err != nil {
		t.Fatal(err)
	}
	e.d.Stop(syscall.SIGKILL)
	ctx := context.Background()
	pods := e.admin.CoreV1().Pods(cluster.DefaultNamespace)
	if err := pods.Delete(ctx, graceful, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	zero := int64(0)
	if err := pods.Delete(ctx, forced, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	if p, err := e.pod(graceful); err != nil || p.DeletionTimestamp == nil {
		t.Fatalf("the gracefully deleted pod: %v %v", err, p)
	}
	if err := syscall.Kill(agent, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{graceful, forced} {
		if _, err := cageserve.AgentPID(id); err != nil {
			t.Fatalf("sandbox %s did not outlive the daemon: %v", id, err)
		}
	}
	e.d.Restart(t)
	e.gone(t, graceful)
	for _, id := range []string{graceful, forced} {
		e.noAgent(t, id)
		if _, status := e.detail(t, id); status != http.StatusNotFound {
			t.Errorf("sandbox %s after the restart: %d", id, status)
		}
	}
	waitFor(t, 30*time.Second, "pod "+lost+" Lost", func() bool {
		p, err := e.pod(lost)
		return err == nil && p.Status.Phase == corev1.PodFailed && p.Status.Reason == cluster.ReasonLost
	})
}

func waitFor(t *testing.T, limit time.Duration, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(limit); !ok(); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, limit)
		}
	}
}

// testPartition cuts the node off the API server: its sandbox runs on
// meanwhile; a pod deleted during the cut has its sandbox destroyed once
// the node is back, and the lease is renewed again.
func (e *nodeEnv) testPartition(t *testing.T) {
	kept, deleted := e.newPod(t, nil), e.newPod(t, nil)
	e.running(t, kept)
	e.running(t, deleted)
	ctx := context.Background()
	leases := e.admin.CoordinationV1().Leases(cluster.NodeLeaseNamespace)
	e.link.cut()
	cutAt := time.Now()
	zero := int64(0)
	if err := e.admin.CoreV1().Pods(cluster.DefaultNamespace).Delete(ctx, deleted, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(4 * time.Second) // more than two renewals missed
	l, err := leases.Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if l.Spec.RenewTime.After(cutAt.Add(500 * time.Millisecond)) {
		t.Fatalf("the lease was renewed during the cut (%v, cut at %v)", l.Spec.RenewTime, cutAt)
	}
	for _, id := range []string{kept, deleted} {
		if _, err := cageserve.AgentPID(id); err != nil {
			t.Fatalf("sandbox %s stopped during the cut: %v", id, err)
		}
	}
	e.link.heal()
	e.noAgent(t, deleted)
	waitFor(t, 15*time.Second, "the lease renewed after the cut", func() bool {
		l2, err := leases.Get(ctx, nodeName, metav1.GetOptions{})
		return err == nil && l2.Spec.RenewTime.After(l.Spec.RenewTime.Time)
	})
	if _, status := e.detail(t, kept); status != http.StatusOK {
		t.Errorf("the kept sandbox after the cut: %d", status)
	}
	if p := e.running(t, kept); p.DeletionTimestamp != nil {
		t.Errorf("the kept pod is being deleted")
	}
}

// link is a TCP relay to addr that the test can cut (every connection
// closed, new ones refused) and heal (on the same address).
type link struct {
	t      *testing.T
	addr   string // where it listens
	target string

	mu    sync.Mutex
	ln    net.Listener
	conns map[net.Conn]bool
}

func newLink(t *testing.T, target string) *link {
	l := &link{t: t, target: target, conns: map[net.Conn]bool{}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l.addr = ln.Addr().String()
	l.serve(ln)
	t.Cleanup(l.cut)
	return l
}

func (l *link) serve(ln net.Listener) {
	l.mu.Lock()
	l.ln = ln
	l.mu.Unlock()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", l.target)
			if err != nil {
				c.Close()
				continue
			}
			l.mu.Lock()
			l.conns[c], l.conns[up] = true, true
			l.mu.Unlock()
			go func() { _, _ = io.Copy(up, c); up.Close() }()
			go func() { _, _ = io.Copy(c, up); c.Close() }()
		}
	}()
}

func (l *link) cut() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ln != nil {
		l.ln.Close()
		l.ln = nil
	}
	for c := range l.conns {
		c.Close()
	}
	l.conns = map[net.Conn]bool{}
}

func (l *link) heal() {
	ln, err := net.Listen("tcp", l.addr)
	if err != nil {
		l.t.Fatal(err)
	}
	l.serve(ln)
}
