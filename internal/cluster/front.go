package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/kube"
	"github.com/cagehq/cage/internal/logbound"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

// FrontConfig is what the front needs of the node it runs on.
type FrontConfig struct {
	Client        *kube.Client
	Namespace     string
	NodeName      string // this node (its sandboxes are served locally)
	NodeKey       []byte // the cluster's node key (Sign)
	LeaseDuration time.Duration
	Log           *slog.Logger
	// BindTimeout bounds the wait for kube-scheduler to bind a new
	// sandbox's pod (default 30 s).
	BindTimeout time.Duration
	// HTTP reaches other nodes (default: a client with no overall timeout,
	// since forwarded streams last as long as they last).
	HTTP *http.Client
	// PerClient bounds one client address's forwards in flight to one
	// node (the daemon's conns_per_client; 0: none; see peers.go).
	PerClient int
}

// Front answers the E2B API for every sandbox of the cluster: creates
// become pods that kube-scheduler places and the owner node starts,
// lists come from the pod informer, and requests for a sandbox on another
// node are forwarded to it (route.go).
type Front struct {
	cfg    FrontConfig
	log    *slog.Logger
	pods   *kube.Informer[corev1.Pod, corev1.PodList]                     // the sandbox pods
	nodes  *kube.Informer[corev1.Node, corev1.NodeList]                   // the cage Nodes
	leases *kube.Informer[coordinationv1.Lease, coordinationv1.LeaseList] // the nodes' Leases

	mu       sync.Mutex
	waiters  map[string]chan struct{} // pod name -> closed on its next change
	gone     map[string]time.Time     // sandboxes killed through this front -> when (Killed)
	forwards map[forwardKey]int       // forwards in flight (holdForward)

	asks    asks             // each owner's lookups of pods at the API server (route.go)
	failLog logbound.Limiter // lines of failed forwards (route.go, forwardFailed)
}

// NewFront returns a front; Start runs it.
func NewFront(cfg FrontConfig) *Front {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.BindTimeout == 0 {
		cfg.BindTimeout = 30 * time.Second
	}
	if cfg.LeaseDuration == 0 {
		cfg.LeaseDuration = 40 * time.Second
	}
	if cfg.HTTP == nil {
		// No overall timeout (streams last as long as they last); a node
		// cut off fails a dial in 5 s, and a request in flight to a node
		// that turns lost is ended then (route.go, whileLive).
		d := &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 15 * time.Second}
		cfg.HTTP = &http.Client{Transport: &http.Transport{Proxy: nil, DialContext: d.DialContext,
			MaxIdleConnsPerHost: 64, IdleConnTimeout: 90 * time.Second}}
	}
	f := &Front{cfg: cfg, log: cfg.Log, waiters: map[string]chan struct{}{}, gone: map[string]time.Time{},
		forwards: map[forwardKey]int{}}
	f.pods = kube.NewInformer(cfg.Client.CoreV1().Pods(cfg.Namespace), metav1.ListOptions{LabelSelector: LabelSandbox + "=true"})
	f.pods.AddHandlers(kube.Handlers[corev1.Pod]{Add: f.changed,
		Update: func(_, p *corev1.Pod) { f.changed(p) }, Delete: f.changed})
	f.nodes = kube.NewInformer(cfg.Client.CoreV1().Nodes(), metav1.ListOptions{LabelSelector: NodeLabel + "=true"})
	f.leases = kube.NewInformer(cfg.Client.CoordinationV1().Leases(NodeLeaseNamespace), metav1.ListOptions{})
	return f
}

// Start runs the informers until ctx ends (so ctx must live as long as
// the front: a request-scoped or timed context stops its view of the
// cluster) and returns once they have synced.
func (f *Front) Start(ctx context.Context) error {
	f.pods.Start(ctx)
	f.leases.Start(ctx)
	f.nodes.Start(ctx)
	if !kube.WaitForSync(ctx, f.pods.HasSynced, f.nodes.HasSynced, f.leases.HasSynced) {
		return fmt.Errorf("cluster front: informers did not sync: %w", ctx.Err())
	}
	return nil
}

// changed wakes whoever waits on a pod.
func (f *Front) changed(p *corev1.Pod) {
	f.mu.Lock()
	if ch, ok := f.waiters[p.Name]; ok {
		close(ch)
		delete(f.waiters, p.Name)
	}
	f.mu.Unlock()
}

// next returns a channel closed at the pod's next change.
func (f *Front) next(name string) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	ch, ok := f.waiters[name]
	if !ok {
		ch = make(chan struct{})
		f.waiters[name] = ch
	}
	return ch
}

// Create makes a sandbox somewhere in the cluster: its pod is created,
// kube-scheduler binds it to a node that has the wall and the room, and
// that node starts it now. A failed start deletes the pod.
func (f *Front) Create(ctx context.Context, req manager.CreateRequest) (*store.Sandbox, error) {
	if !slices.Contains(sandbox.Walls, req.Wall) {
		return nil, fmt.Errorf("%w: unknown wall %q (walls: %v)", sandbox.ErrInvalid, req.Wall, sandbox.Walls)
	}
	if f.nodesWith(req.Wall) == 0 {
		// Known without asking the API server (nor making a pod).
		return nil, fmt.Errorf("%w: no node of the cluster can run wall %s", sandbox.ErrUnavailable, req.Wall)
	}
	id := ids.NewID()
	pod, err := PodFor(id, req, f.cfg.Namespace)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", sandbox.ErrInvalid, err)
	}
	pods := f.cfg.Client.CoreV1().Pods(f.cfg.Namespace)
	wake := f.next(id) // before the create, so no change is missed
	if _, err := pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		f.forget(id)
		return nil, fmt.Errorf("%w: cluster: create pod: %v", sandbox.ErrUnavailable, err)
	}
	node, err := f.bound(ctx, id, req.Wall, wake)
	f.forget(id)
	if err == nil {
		var rec *store.Sandbox
		if rec, err = f.start(ctx, node, id); err == nil {
			return rec, nil
		}
	}
	if derr := f.deletePod(context.WithoutCancel(ctx), id); derr != nil {
		f.log.Warn("cluster: delete the pod of a failed create", "sandbox", id, "err", derr)
	}
	return nil, err
}

func (f *Front) forget(name string) {
	f.mu.Lock()
	delete(f.waiters, name)
	f.mu.Unlock()
}

// goneFor is how long a sandbox killed through this front is left out of
// its lists whatever its informer still holds.
const goneFor = time.Minute

// Killed is told of a sandbox killed through this front (here or on its
// node): its pod is deleted now, before the kill is answered, rather than
// a moment later by the owner node, so that a list right after the kill,
// here or on another front, no longer shows it (this front's informer may
// lag the deletion by a few milliseconds: the sandbox is left out of its
// lists for goneFor).
func (f *Front) Killed(ctx context.Context, id string) {
	now := time.Now()
	f.mu.Lock()
	for k, at := range f.gone {
		if now.Sub(at) > goneFor {
			delete(f.gone, k)
		}
	}
	f.gone[id] = now
	f.mu.Unlock()
	if err := f.deletePod(ctx, id); err != nil {
		f.log.Warn("cluster: delete the pod of a killed sandbox", "sandbox", id, "err", err)
	}
}

// killed says whether sandbox id was killed through this front lately.
func (f *Front) killed(id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	at, ok := f.gone[id]
	return ok && time.Since(at) <= goneFor
}

// deletePod deletes a sandbox's pod now (grace 0); gone already is fine.
func (f *Front) deletePod(ctx context.Context, name string) error {
	zero := int64(0)
	err := f.cfg.Client.CoreV1().Pods(f.cfg.Namespace).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	if kube.IsNotFound(err) {
		return nil
	}
	return err
}

// bound waits until the pod is bound to a node and returns the node;
// a pod the scheduler finds no node for is an error that says why.
func (f *Front) bound(ctx context.Context, id, wall string, wake <-chan struct{}) (string, error) {
	timer := time.NewTimer(f.cfg.BindTimeout)
	defer timer.Stop()
	for {
		if p, err := f.pods.Get(id); err == nil {
			if p.Spec.NodeName != "" {
				return p.Spec.NodeName, nil
			}
			if c := condition(p, corev1.PodScheduled); c != nil && c.Status == corev1.ConditionFalse &&
				c.Reason == corev1.PodReasonUnschedulable {
				return "", f.unschedulable(wall, c.Message)
			}
		}
		select {
		case <-wake:
			wake = f.next(id)
		case <-ctx.Done():
			return "", ctx.Err()
		case <-timer.C:
			return "", fmt.Errorf("%w: no node took sandbox %s within %s (is kube-scheduler running?)",
				sandbox.ErrUnavailable, id, f.cfg.BindTimeout)
		}
	}
}

// unschedulable says why no node can take a sandbox of wall.
func (f *Front) unschedulable(wall, why string) error {
	if f.nodesWith(wall) == 0 {
		return fmt.Errorf("%w: no node of the cluster can run wall %s", sandbox.ErrUnavailable, wall)
	}
	if why == "" {
		why = "no reason given"
	}
	return fmt.Errorf("%w: no node has room for the sandbox (kube-scheduler: %s)", sandbox.ErrUnavailable, oneLine(why))
}

// nodesWith counts the cage Nodes labelled for wall.
func (f *Front) nodesWith(wall string) int {
	nodes := f.nodes.List()
	can := 0
	for _, n := range nodes {
		if n.Labels[WallLabelPrefix+wall] == "true" {
			can++
		}
	}
	return can
}

// condition returns the pod's condition of type t (nil: none).
func condition(p *corev1.Pod, t corev1.PodConditionType) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == t {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

// startTimeout bounds a node's start of a sandbox (a node cut off from
// this one may not answer at all).
const startTimeout = 2 * time.Minute

// start asks the owner node to start the sandbox of pod id now and
// returns its record.
func (f *Front) start(ctx context.Context, node, id string) (*store.Sandbox, error) {
	if lost, expired := f.lost(node); lost {
		// Bound before the lifecycle tainted it: fail now, not at a
		// timeout (the client may retry: the taint sends it elsewhere).
		return nil, fmt.Errorf("%w: %s", sandbox.ErrUnavailable, trimKind(lostError(id, node, expired)))
	}
	base, err := f.nodeURL(node, AnnoAPI)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	u := base.JoinPath("/cluster/pods", id, "start")
	u.RawQuery = "pool=1" // the node may answer with a prepared sandbox of its pool
	r, err := http.NewRequestWithContext(ctx, http.MethodPost, u.String(), http.NoBody)
	if err != nil {
		return nil, err
	}
	Sign(r, f.cfg.NodeKey, f.cfg.NodeName, node, ForInternal)
	resp, err := f.cfg.HTTP.Do(r)
	if err != nil {
		return nil, fmt.Errorf("%w: node %s did not answer the start of sandbox %s: %v", sandbox.ErrUnavailable, node, id, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, fmt.Errorf("%w: node %s: reading the start of sandbox %s: %v", sandbox.ErrUnavailable, node, id, err)
	}
	if resp.StatusCode/100 != 2 {
		return nil, remoteError(node, resp.StatusCode, body)
	}
	// The record's id may differ from the pod's: a node that claims a
	// prepared sandbox of its pool answers with it (its own id, with a pod
	// of that name) and deletes the claim's pod.
	var rec store.Sandbox
	if err := json.Unmarshal(body, &rec); err != nil || !ids.Valid(rec.ID) {
		return nil, fmt.Errorf("node %s answered the start of sandbox %s with no record of it", node, id)
	}
	return &rec, nil
}

// remoteError is another node's error answer as an error of the kind
// whose status the API gives.
func remoteError(node string, status int, body []byte) error {
	var e struct {
		Message string `json:"message"`
	}
	msg := strings.TrimSpace(string(body))
	if json.Unmarshal(body, &e) == nil && e.Message != "" {
		msg = e.Message
	}
	msg = oneLine(msg)
	var kind error
	switch status {
	case http.StatusBadRequest:
		kind = sandbox.ErrInvalid
	case http.StatusNotFound:
		kind = manager.ErrNotFound
	case http.StatusConflict:
		kind = manager.ErrConflict
	case http.StatusTooManyRequests:
		kind = manager.ErrLimit
	case http.StatusServiceUnavailable:
		kind = sandbox.ErrUnavailable
	default:
		return fmt.Errorf("node %s answered %d: %s", node, status, msg)
	}
	return fmt.Errorf("%w: %s", kind, strings.TrimPrefix(msg, kind.Error()+": "))
}

// nodeURL is the base URL in a node's annotation (AnnoAPI or AnnoProxy).
func (f *Front) nodeURL(node, anno string) (*url.URL, error) {
	n, err := f.nodes.Get(node)
	if err != nil {
		return nil, fmt.Errorf("%w: node %s is not a cage node of the cluster", sandbox.ErrUnavailable, node)
	}
	u, err := url.Parse(n.Annotations[anno])
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("%w: node %s has no usable %s annotation (%q)", sandbox.ErrUnavailable, node, anno, n.Annotations[anno])
	}
	return u, nil
}

// errLost is a sandbox on a node whose lease has expired.
var errLost = errors.New("lost")

// lost says whether node's lease has expired, and when.
func (f *Front) lost(node string) (bool, time.Time) {
	l, err := f.leases.Get(node)
	if err != nil || l.Spec.RenewTime == nil {
		return true, time.Time{}
	}
	d := f.cfg.LeaseDuration
	if l.Spec.LeaseDurationSeconds != nil {
		d = time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second
	}
	end := l.Spec.RenewTime.Add(d)
	return time.Now().After(end), end
}

// lostError is the one line a client gets for a sandbox on a lost node.
func lostError(id, node string, expired time.Time) error {
	when := "never renewed"
	if !expired.IsZero() {
		when = "lease expired at " + expired.UTC().Format(time.RFC3339)
	}
	return fmt.Errorf("%w: sandbox %s is on node %s, which is lost (%s)", errLost, id, node, when)
}
