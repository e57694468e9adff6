package cluster

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/kube"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

// The pods bound to this node, and this host's sandboxes: every change to
// either (the pod watch, the manager's Changed hook, a start call) queues
// the pod's name, and sync brings the two together: a pending pod gets its
// sandbox (one create per pod, whoever asks first), a running sandbox's
// pod its status and annotations, a deleted pod's sandbox is destroyed, an
// ended sandbox's pod deleted.

// startCall is a create in progress (singleflight by pod name).
type startCall struct {
	done chan struct{}
	rec  *store.Sandbox
	err  error
}

// createTimeout bounds one create from a pod; startGrace is how long the
// watch leaves a new pod to the front's start call.
const (
	createTimeout = 5 * time.Minute
	startGrace    = 2 * time.Second // from creationTimestamp, whole seconds: 1 to 2 s
)

// Changed is the manager's hook (manager.Config.Changed): the sandbox's
// pod is synced with its record.
func (n *Node) Changed(id, kind string) {
	n.mu.Lock()
	switch kind {
	case audit.KindKill, audit.KindDied, audit.KindRemoved, audit.KindTimeout:
		n.ended[id] = kind
	case audit.KindCreate:
		if _, fromPod := n.starts[id]; !fromPod {
			// Made here, not for a pod (a fork's child, Dify's
			// sandboxes): it gets a pod bound to this node.
			n.adopting[id] = true
		}
	}
	n.mu.Unlock()
	n.queue.Add(id)
}

func (n *Node) enqueuePod(p *corev1.Pod) { n.queue.Add(p.Name) }

func (n *Node) work() {
	for {
		id, quit := n.queue.Get()
		if quit {
			return
		}
		if err := n.sync(id); err != nil {
			n.log.Warn("cluster: pod sync", "pod", id, "err", err)
			n.queue.AddRateLimited(id)
		} else {
			n.queue.Forget(id)
		}
		n.queue.Done(id)
	}
}

// sync brings pod id and sandbox id together.
func (n *Node) sync(id string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pod, err := n.pods.Get(id)
	if kube.IsNotFound(err) {
		pod = nil
	} else if err != nil {
		return err
	}
	n.mu.Lock()
	_, creating := n.starts[id]
	why, ended := n.ended[id]
	failed := n.failed[id] != nil
	adopting := n.adopting[id]
	claimed := n.claimed[id] != ""
	if pod == nil {
		delete(n.claimed, id)
	}
	if pod != nil {
		delete(n.adopting, id) // the watch has its pod
	}
	n.mu.Unlock()
	rec, recErr := n.mgr.Record(id)
	local := recErr == nil
	if recErr != nil && !errors.Is(recErr, manager.ErrNotFound) {
		return recErr
	}
	switch {
	case creating:
		return nil // the create syncs again when it is done
	case claimed && pod != nil:
		return n.deletePod(ctx, pod)
	case pod == nil && local && adopting:
		return n.adopt(ctx, rec)
	case pod == nil || pod.DeletionTimestamp != nil:
		return n.syncGone(ctx, id, pod, local)
	case local:
		if pod.Status.Phase == corev1.PodFailed {
			// A pod reported lost whose sandbox is here after all (it was
			// not: Lost is written only when the record is gone): its
			// record is the truth, the pod is gone for the front.
			return n.mgr.Kill("", id)
		}
		return n.report(ctx, pod, rec)
	case ended:
		n.log.Info("cluster: sandbox ended; deleting its pod", "sandbox", id, "why", why)
		if why == audit.KindDied || why == audit.KindRemoved { // a kill or a timeout is the caller's own doing
			n.event(pod, corev1.EventTypeWarning, "Ended", "sandbox ended ("+strings.TrimPrefix(why, "sandbox.")+")")
		}
		return n.deletePod(ctx, pod)
	default:
		return n.syncOrphan(ctx, pod, failed)
	}
}

// syncGone: pod id is gone or marked for deletion; its sandbox is
// destroyed, then the pod deleted (as a kubelet confirms a deletion), and
// once it is gone what the node kept about it is forgotten.
func (n *Node) syncGone(ctx context.Context, id string, pod *corev1.Pod, local bool) error {
	if local {
		n.log.Info("cluster: pod deleted; destroying its sandbox", "sandbox", id)
		if pod != nil {
			n.event(pod, corev1.EventTypeNormal, "Killing", "pod deleted: destroying sandbox "+id)
		}
		if err := n.mgr.Kill("", id); err != nil && !errors.Is(err, manager.ErrNotFound) {
			return err
		}
	}
	if pod != nil {
		return n.deletePod(ctx, pod)
	}
	n.mu.Lock()
	delete(n.ended, id)
	delete(n.reported, id)
	delete(n.failed, id)
	delete(n.adopting, id)
	delete(n.deleted, id)
	delete(n.endAt, id)
	n.mu.Unlock()
	return nil
}

// syncOrphan: a pod bound here whose sandbox this host does not have and
// whose end it has not seen.
func (n *Node) syncOrphan(ctx context.Context, pod *corev1.Pod, failed bool) error {
	id := pod.Name
	switch {
	case pod.Status.Phase == corev1.PodPending && !failed:
		// The front that made the pod starts it at once (and may have
		// it take a pooled sandbox); the watch starts a pod nobody
		// started within startGrace of its making (kubectl's, or a
		// front's that died).
		if wait := startGrace - time.Since(pod.CreationTimestamp.Time); wait > 0 {
			n.queue.AddAfter(id, wait)
			return nil
		}
		go func() { _, _ = n.start(context.Background(), id, false) }()
		return nil
	case pod.Status.Phase == corev1.PodRunning:
		// Running, but this host has no such sandbox and no word of its
		// end: it was lost (the host restarted and the sandbox was gone).
		return n.fail(ctx, pod, ReasonLost, fmt.Sprintf("sandbox %s is not on node %s any more", id, n.cfg.NodeName))
	default: // Failed or Succeeded: kept for the front, then deleted
		if since := failedAt(pod); !since.IsZero() && time.Since(since) > n.cfg.Retention {
			return n.deletePod(ctx, pod)
		} else if !since.IsZero() {
			n.queue.AddAfter(id, n.cfg.Retention-time.Since(since)+time.Second)
		}
		return nil
	}
}

// adopt makes the pod of a sandbox made on this host without one, bound
// here and Running, so that the cluster sees it as any other.
func (n *Node) adopt(ctx context.Context, rec *store.Sandbox) error {
	pol, err := manager.DecodePolicy(rec.Network)
	if err != nil {
		pol = network.Policy{}
	}
	req := manager.CreateRequest{Wall: rec.Wall, KeyID: rec.KeyID, Template: rec.TemplateID,
		Timeout: time.Duration(rec.TimeoutSeconds) * time.Second, Metadata: rec.Metadata, Env: rec.EnvVars,
		CPUs: rec.CPUs, Memory: rec.Memory, Disk: rec.Disk, Pids: rec.Pids, Net: pol,
		PublicTraffic: rec.PublicTraffic, HTTPSPorts: rec.HTTPSPorts,
		AutoPause: rec.AutoPause, AutoPauseMemory: rec.AutoPauseMemory, AutoResume: rec.AutoResume}
	for _, v := range rec.VolumeMounts {
		req.Volumes = append(req.Volumes, manager.VolumeMount{Name: v.Name, Path: v.Path})
	}
	pod, err := PodFor(rec.ID, req, n.cfg.Namespace)
	if err != nil {
		n.mu.Lock()
		delete(n.adopting, rec.ID)
		n.mu.Unlock()
		n.log.Warn("cluster: a sandbox of this host gets no pod; it is destroyed", "sandbox", rec.ID, "err", err)
		return n.mgr.Kill("", rec.ID)
	}
	pod.Spec.NodeName = n.cfg.NodeName
	made, err := n.client.CoreV1().Pods(n.cfg.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if kube.IsAlreadyExists(err) {
		return nil // the watch brings it
	}
	if err != nil {
		return err
	}
	if err := n.report(ctx, made, rec); kube.IsConflict(err) {
		// The pod's watch event came first and its sync has written
		// the status since: the sync (queued again here) has the
		// latest copy.
		n.queue.Add(made.Name)
		return nil
	} else if err != nil {
		return err
	}
	return nil
}

// start creates the sandbox of pod id now, or waits for the create in
// progress, and returns its record. With pooled, the sandbox may be a
// prepared one of this node's pool, whose id is its own: pod id was then
// a claim, which is deleted, and the sandbox gets a pod of its own name.
func (n *Node) start(ctx context.Context, id string, pooled bool) (*store.Sandbox, error) {
	n.mu.Lock()
	if got := n.claimed[id]; got != "" {
		n.mu.Unlock()
		return n.mgr.Record(got)
	}
	if c := n.starts[id]; c != nil {
		n.mu.Unlock()
		select {
		case <-c.done:
			return c.rec, c.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if rec, err := n.mgr.Record(id); err == nil {
		n.mu.Unlock()
		return rec, nil
	}
	if err := n.failed[id]; err != nil {
		n.mu.Unlock()
		return nil, err
	}
	c := &startCall{done: make(chan struct{})}
	n.starts[id] = c
	n.mu.Unlock()
	c.rec, c.err = n.create(id, pooled)
	n.mu.Lock()
	delete(n.starts, id)
	n.mu.Unlock()
	close(c.done)
	n.queue.Add(id) // report it, or destroy it if its pod went meanwhile
	return c.rec, c.err
}

// create makes the sandbox of pod id (read from the API server: the
// front calls start as soon as the pod is bound, before the watch may
// have it).
func (n *Node) create(id string, pooled bool) (*store.Sandbox, error) {
	ctx, cancel := context.WithTimeout(context.Background(), createTimeout)
	defer cancel()
	pod, err := n.pods.Get(id)
	if err != nil || pod.Spec.NodeName != n.cfg.NodeName {
		pod, err = n.client.CoreV1().Pods(n.cfg.Namespace).Get(ctx, id, metav1.GetOptions{})
	}
	if kube.IsNotFound(err) {
		return nil, fmt.Errorf("%w: no sandbox pod %q", manager.ErrNotFound, id)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: reading pod %s: %v", sandbox.ErrUnavailable, id, err)
	}
	switch {
	case pod.Spec.NodeName != n.cfg.NodeName:
		return nil, fmt.Errorf("%w: pod %s is bound to %q, not to node %s", manager.ErrConflict, id, pod.Spec.NodeName, n.cfg.NodeName)
	case pod.DeletionTimestamp != nil:
		return nil, fmt.Errorf("%w: pod %s is being deleted", manager.ErrNotFound, id)
	case pod.Status.Phase != corev1.PodPending && pod.Status.Phase != "":
		return nil, fmt.Errorf("%w: pod %s is %s", manager.ErrConflict, id, pod.Status.Phase)
	}
	req, err := RequestFrom(pod)
	if err != nil {
		return nil, n.createFailed(ctx, pod, fmt.Errorf("%w: %v", sandbox.ErrInvalid, err))
	}
	if pooled && n.poolReady(req) {
		req.ID = "" // the prepared sandbox's own
	}
	rec, err := n.mgr.Create(ctx, req)
	if err != nil {
		return nil, n.createFailed(ctx, pod, err)
	}
	if rec.ID != id {
		return n.claim(ctx, pod, rec)
	}
	if err := n.report(ctx, pod, rec); err != nil {
		n.log.Warn("cluster: pod status", "pod", id, "err", err)
	}
	return rec, nil
}

// poolReady says whether a pool of this node has a sandbox ready for req
// (its wall and template; whether it fits is the pool's to say).
//
// Never on the process wall: there a create without the pool (under the
// pod's name) is faster than a claim, whose sandbox pod and claim
// deletion cost two more requests (measured here on one node: claim p50
// 42 ms pooled, 28 ms unpooled). On runc, gVisor and microvm a prepared
// sandbox saves far more than that.
func (n *Node) poolReady(req manager.CreateRequest) bool {
	if n.cfg.Host == nil || req.Wall == "process" {
		return false
	}
	tmpl := req.Template
	if tmpl == "" {
		tmpl = n.cfg.Host.DefaultTemplate(req.Wall)
	}
	for _, s := range n.cfg.Host.PoolStats() {
		if s.Wall == req.Wall && s.Template == tmpl && s.Ready > 0 {
			return true
		}
	}
	return false
}

// claim turns the pod that asked for a sandbox (a claim) into the pod of
// rec, a sandbox of another id (the pool's): rec's pod is made, bound
// here, before the claim is deleted; without its pod the sandbox is
// destroyed and the create fails.
func (n *Node) claim(ctx context.Context, claim *corev1.Pod, rec *store.Sandbox) (*store.Sandbox, error) {
	n.mu.Lock()
	n.claimed[claim.Name] = rec.ID
	n.adopting[rec.ID] = true
	n.mu.Unlock()
	if err := n.adopt(ctx, rec); err != nil {
		_ = n.mgr.Kill("", rec.ID)
		return nil, n.createFailed(ctx, claim, fmt.Errorf("%w: the pod of sandbox %s: %v", sandbox.ErrUnavailable, rec.ID, err))
	}
	if err := n.deletePod(ctx, claim); err != nil {
		n.log.Warn("cluster: delete a claim", "pod", claim.Name, "err", err)
	}
	return rec, nil
}
