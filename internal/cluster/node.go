package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"runtime"
	"slices"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"

	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/kube"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

// NodeConfig is what a Node needs besides Config.
type NodeConfig struct {
	Config
	Manager *manager.Manager
	Host    *sandbox.Host
	Log     *slog.Logger
	Version string // cage's, for the Node's nodeInfo
	// MaxSandboxes is the Node's pod capacity (the daemon's max_sandboxes).
	MaxSandboxes int
	// Walls are the walls this host runs (labels WallLabelPrefix+wall).
	Walls []string
	// Retention is how long a Failed pod (CreateFailed, Lost) is kept for
	// the front to show before the node deletes it (0: 10 minutes).
	Retention time.Duration
}

// Node is a cage host as a node of the cluster: it registers a Node,
// keeps its Lease, runs the sandbox pods bound to it (pods.go) and serves
// the internal routes (Routes). The front uses Client, Key and Name.
type Node struct {
	cfg    NodeConfig
	client *kube.Client
	key    []byte
	log    *slog.Logger
	mgr    *manager.Manager

	pods  *kube.Informer[corev1.Pod, corev1.PodList] // the sandbox pods bound to this node
	queue *kube.Queue                                // pod names to sync

	mu        sync.Mutex
	starts    map[string]*startCall // pod name -> the create in progress (singleflight)
	ended     map[string]string     // sandbox id -> why it ended, until its pod is gone
	reported  map[string]string     // pod name -> "uid|end|state" last written (report)
	failed    map[string]error      // pod name -> why its create failed (never tried again)
	adopting  map[string]bool       // sandboxes made here without a pod, until the watch has theirs
	deleted   map[string]types.UID  // pods this node deleted, until the watch has them gone
	claimed   map[string]string     // claim pod -> the pooled sandbox it got (start?pool=1), until the claim is gone
	endAt     map[string]time.Time  // pod name -> when report last wrote a change of its end alone
	renewedOK bool                  // the last lease renewal succeeded (a failure, then a success: reconcile)
}

// NewNode connects to the cluster of cfg (no request is made yet).
func NewNode(cfg NodeConfig) (*Node, error) {
	if err := cfg.Defaults(); err != nil {
		return nil, err
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Retention == 0 {
		cfg.Retention = 10 * time.Minute
	}
	c, err := cfg.Client()
	if err != nil {
		return nil, err
	}
	return newNode(cfg, c), nil
}

func newNode(cfg NodeConfig, c *kube.Client) *Node {
	n := &Node{cfg: cfg, client: c, log: cfg.Log.With("node", cfg.NodeName), mgr: cfg.Manager,
		starts: map[string]*startCall{}, ended: map[string]string{}, reported: map[string]string{}, failed: map[string]error{}, adopting: map[string]bool{}, deleted: map[string]types.UID{}, claimed: map[string]string{}, endAt: map[string]time.Time{}, renewedOK: true,
		queue: kube.NewQueue()}
	n.pods = kube.NewInformer(c.CoreV1().Pods(cfg.Namespace), metav1.ListOptions{LabelSelector: LabelSandbox + "=true",
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", cfg.NodeName).String()})
	n.pods.AddHandlers(kube.Handlers[corev1.Pod]{Add: n.enqueuePod,
		Update: func(_, p *corev1.Pod) { n.enqueuePod(p) }, Delete: n.enqueuePod})
	return n
}

// Client is the node's client of the API server.
func (n *Node) Client() *kube.Client { return n.client }

// Key is the cluster's node key (after Start).
func (n *Node) Key() []byte { return n.key }

// Name is the node's name.
func (n *Node) Name() string { return n.cfg.NodeName }

// Config is the node's configuration, defaults filled.
func (n *Node) Config() Config { return n.cfg.Config }

// Start registers the Node, reads (or makes) the node key, syncs the pod
// informer, reconciles this host's sandboxes with the pods bound to it,
// and then keeps the Lease and runs the pods until ctx ends.
func (n *Node) Start(ctx context.Context) error {
	key, err := NodeKey(ctx, n.client, n.cfg.Namespace)
	if err != nil {
		return err
	}
	n.key = key
	if err := n.register(ctx); err != nil {
		return err
	}
	if err := n.renew(ctx); err != nil {
		return fmt.Errorf("cluster: lease: %w", err)
	}
	n.pods.Start(ctx)
	if !kube.WaitForSync(ctx, n.pods.HasSynced) {
		return fmt.Errorf("cluster: the pod watch did not sync: %w", ctx.Err())
	}
	n.reconcile()
	for range 4 {
		go n.work()
	}
	go func() { <-ctx.Done(); n.queue.ShutDown() }()
	go n.keepLease(ctx)
	go n.heartbeat(ctx)
	go n.labelAccel(ctx)
	n.log.Info("cluster: node joined", "namespace", n.cfg.Namespace, "advertise", n.cfg.Advertise, "walls", n.cfg.Walls)
	return nil
}

// register creates or updates the Node object and its status.
func (n *Node) register(ctx context.Context) error {
	nodes := n.client.CoreV1().Nodes()
	want := n.nodeObject()
	cur, err := nodes.Get(ctx, n.cfg.NodeName, metav1.GetOptions{})
	switch {
	case kube.IsNotFound(err):
		cur, err = nodes.Create(ctx, want, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("cluster: register node %s: %w", n.cfg.NodeName, err)
		}
	case err != nil:
		return fmt.Errorf("cluster: node %s: %w", n.cfg.NodeName, err)
	default:
		// Ours to set: our labels (walls come and go), taint, annotations.
		for k := range cur.Labels {
			if len(k) > len(WallLabelPrefix) && k[:len(WallLabelPrefix)] == WallLabelPrefix {
				delete(cur.Labels, k)
			}
		}
		if cur.Labels == nil {
			cur.Labels = map[string]string{}
		}
		for k, v := range want.Labels {
			cur.Labels[k] = v
		}
		if cur.Annotations == nil {
			cur.Annotations = map[string]string{}
		}
		for k, v := range want.Annotations {
			cur.Annotations[k] = v
		}
		if !hasTaint(cur, Taint) {
			cur.Spec.Taints = append(cur.Spec.Taints, want.Spec.Taints...)
		}
		if cur, err = nodes.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("cluster: update node %s: %w", n.cfg.NodeName, err)
		}
	}
	cur.Status = n.nodeStatus(cur.Status)
	if _, err := nodes.UpdateStatus(ctx, cur, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("cluster: node %s status: %w", n.cfg.NodeName, err)
	}
	return nil
}

func (n *Node) nodeObject() *corev1.Node {
	labels := map[string]string{NodeLabel: "true", "kubernetes.io/hostname": n.cfg.NodeName,
		"kubernetes.io/os": "linux", "kubernetes.io/arch": runtime.GOARCH, "type": "virtual-kubelet"}
	for _, w := range n.cfg.Walls {
		labels[WallLabelPrefix+w] = "true"
	}
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: n.cfg.NodeName, Labels: labels, Annotations: map[string]string{
			AnnoAPI:   fmt.Sprintf("http://%s:%d", hostPort(n.cfg.Advertise), n.cfg.APIPort),
			AnnoProxy: fmt.Sprintf("http://%s:%d", hostPort(n.cfg.Advertise), n.cfg.ProxyPort)}},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: Taint, Value: "true", Effect: corev1.TaintEffectNoSchedule}}},
	}
}

// hostPort brackets an IPv6 address for a URL.
func hostPort(ip string) string {
	for i := 0; i < len(ip); i++ {
		if ip[i] == ':' {
			return "[" + ip + "]"
		}
	}
	return ip
}

// nodeStatus is the Node's status now: capacity, addresses, Ready.
func (n *Node) nodeStatus(old corev1.NodeStatus) corev1.NodeStatus {
	now := metav1.Now()
	cap := corev1.ResourceList{
		corev1.ResourceCPU: *resource.NewMilliQuantity(int64(float64(runtime.NumCPU())*n.cfg.CPUOvercommit*1000),
			resource.DecimalSI),
		corev1.ResourceMemory: *resource.NewQuantity(int64(float64(sandbox.HostMemory())*n.cfg.MemoryOvercommit),
			resource.BinarySI),
		corev1.ResourcePods: *resource.NewQuantity(int64(max(n.cfg.MaxSandboxes, 1)), resource.DecimalSI),
	}
	ready := corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "CageReady",
		Message: "cage serve is running", LastHeartbeatTime: now, LastTransitionTime: now}
	for _, c := range old.Conditions {
		if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
			ready.LastTransitionTime = c.LastTransitionTime
		}
	}
	conds := []corev1.NodeCondition{ready}
	for _, c := range old.Conditions {
		if c.Type != corev1.NodeReady {
			conds = append(conds, c)
		}
	}
	return corev1.NodeStatus{
		Capacity: cap, Allocatable: cap.DeepCopy(), Phase: corev1.NodeRunning, Conditions: conds,
		Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: n.cfg.Advertise},
			{Type: corev1.NodeHostName, Address: n.cfg.NodeName}},
		DaemonEndpoints: corev1.NodeDaemonEndpoints{KubeletEndpoint: corev1.DaemonEndpoint{Port: int32(n.cfg.APIPort)}},
		NodeInfo: corev1.NodeSystemInfo{KubeletVersion: "cage/" + n.cfg.Version, KubeProxyVersion: "",
			OperatingSystem: "linux", Architecture: runtime.GOARCH, ContainerRuntimeVersion: "cage://" + n.cfg.Version},
	}
}

// labelAccel labels the Node with how its microvm wall runs guests
// (LabelMicrovmAccel: kvm, or tcg, which is for development only), once
// the wall's probe (up to 10 s, once per boot) has said.
func (n *Node) labelAccel(ctx context.Context) {
	if n.cfg.Host == nil || !slices.Contains(n.cfg.Walls, "microvm") {
		return
	}
	accel := "kvm"
	if n.cfg.Host.Warning(ctx, "microvm") != "" {
		accel = "tcg"
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{LabelMicrovmAccel: accel}}})
	if _, err := n.client.CoreV1().Nodes().Patch(ctx, n.cfg.NodeName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil && ctx.Err() == nil {
		n.log.Warn("cluster: node label", "label", LabelMicrovmAccel, "err", err)
	}
}

// heartbeat refreshes the Node's status (Ready, capacity) every minute,
// as a kubelet does between its lease renewals.
func (n *Node) heartbeat(ctx context.Context) {
	t := time.NewTicker(time.Minute)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		cur, err := n.client.CoreV1().Nodes().Get(ctx, n.cfg.NodeName, metav1.GetOptions{})
		if kube.IsNotFound(err) {
			err = n.register(ctx) // deleted by an operator: join again
		} else if err == nil {
			cur.Status = n.nodeStatus(cur.Status)
			_, err = n.client.CoreV1().Nodes().UpdateStatus(ctx, cur, metav1.UpdateOptions{})
		}
		if err != nil && ctx.Err() == nil {
			n.log.Warn("cluster: node status", "err", err)
		}
	}
}

// keepLease renews the Lease every LeaseDuration/4; after renewals that
// failed (a partition from the API server), the first that succeeds
// reconciles this host with the pods again.
func (n *Node) keepLease(ctx context.Context) {
	t := time.NewTicker(n.cfg.LeaseDuration / 4)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, n.cfg.LeaseDuration/4)
		err := n.renew(rctx)
		cancel()
		n.mu.Lock()
		healed := err == nil && !n.renewedOK
		n.renewedOK = err == nil
		n.mu.Unlock()
		if err != nil && ctx.Err() == nil {
			n.log.Warn("cluster: lease not renewed", "err", err)
		}
		if healed {
			n.log.Info("cluster: lease renewed again; reconciling")
			n.reconcile()
		}
	}
}

// renew creates or renews the node's Lease.
func (n *Node) renew(ctx context.Context) error {
	leases := n.client.CoordinationV1().Leases(NodeLeaseNamespace)
	now := metav1.NewMicroTime(time.Now())
	secs := int32(n.cfg.LeaseDuration / time.Second)
	l, err := leases.Get(ctx, n.cfg.NodeName, metav1.GetOptions{})
	if kube.IsNotFound(err) {
		_, err = leases.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: n.cfg.NodeName, Namespace: NodeLeaseNamespace},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: &n.cfg.NodeName, LeaseDurationSeconds: &secs,
				AcquireTime: &now, RenewTime: &now},
		}, metav1.CreateOptions{})
		return err
	}
	if err != nil {
		return err
	}
	l.Spec.HolderIdentity, l.Spec.LeaseDurationSeconds, l.Spec.RenewTime = &n.cfg.NodeName, &secs, &now
	_, err = leases.Update(ctx, l, metav1.UpdateOptions{})
	return err
}

// reconcile compares this host's sandboxes with the pods bound to it (at
// start, and after a partition from the API server heals): a sandbox with
// no pod is destroyed; every pod is synced (a running pod whose sandbox is
// gone is reported Lost).
func (n *Node) reconcile() {
	var cursor string
	for {
		recs, next, err := n.mgr.List(store.ListFilter{Limit: 500, Cursor: cursor})
		if err != nil {
			n.log.Warn("cluster: reconcile: list sandboxes", "err", err)
			break
		}
		for _, rec := range recs {
			n.mu.Lock()
			_, creating := n.starts[rec.ID]
			creating = creating || n.adopting[rec.ID] // its pod is on its way
			n.mu.Unlock()
			if creating {
				continue
			}
			if _, err := n.pods.Get(rec.ID); kube.IsNotFound(err) {
				n.log.Info("cluster: reconcile: sandbox has no pod; destroying it", "sandbox", rec.ID)
				if err := n.mgr.Kill("", rec.ID); err != nil && !errors.Is(err, manager.ErrNotFound) {
					n.log.Warn("cluster: reconcile: kill", "sandbox", rec.ID, "err", err)
				}
			}
		}
		if next == "" {
			break
		}
		cursor = next
	}
	for _, p := range n.pods.List() {
		n.queue.Add(p.Name)
	}
}

// Routes serves the internal routes (/cluster/...) on the node's API
// listener, node-authenticated before anything is read; other requests go
// to next.
func (n *Node) Routes(next http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /cluster/pods/{name}/start", n.serveStart)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(r.URL.Path) < len("/cluster/") || r.URL.Path[:len("/cluster/")] != "/cluster/" {
			next.ServeHTTP(w, r)
			return
		}
		if _, err := Verify(r, n.key, n.cfg.NodeName, ForInternal); err != nil {
			w.Header().Set("Connection", "close") // the body is never read
			writeErr(w, http.StatusUnauthorized, err.Error())
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// serveStart is POST /cluster/pods/{name}/start: the sandbox of that pod,
// made now (or by the create in progress); the answer is its record,
// secrets included, for the front to answer the create with.
func (n *Node) serveStart(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	if !ids.Valid(name) {
		writeErr(w, http.StatusNotFound, fmt.Sprintf("no sandbox pod %q", name))
		return
	}
	rec, err := n.start(r.Context(), name, r.URL.Query().Get("pool") == "1")
	if err != nil {
		writeErr(w, statusOf(err), oneLine(err.Error()))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_ = json.NewEncoder(w).Encode(rec)
}

func statusOf(err error) int {
	switch {
	case errors.Is(err, manager.ErrNotFound), errors.Is(err, sandbox.ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, sandbox.ErrInvalid):
		return http.StatusBadRequest
	case errors.Is(err, manager.ErrConflict):
		return http.StatusConflict
	case errors.Is(err, manager.ErrLimit), errors.Is(err, manager.ErrQuota):
		return http.StatusTooManyRequests
	case errors.Is(err, sandbox.ErrUnavailable), errors.Is(err, context.DeadlineExceeded):
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

func writeErr(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"code": status, "message": msg})
}
