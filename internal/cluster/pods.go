package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"

	"github.com/cagehq/cage/internal/audit"
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

func (n *Node) enqueueObj(o any) {
	if k, err := cache.DeletionHandlingMetaNamespaceKeyFunc(o); err == nil {
		if _, name, err := cache.SplitMetaNamespaceKey(k); err == nil {
			n.queue.Add(name)
		}
	}
}

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
	pod, err := n.pods.Pods(n.cfg.Namespace).Get(id)
	if apierrors.IsNotFound(err) {
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
		n.mu.Unlock()
		return nil
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
	if apierrors.IsAlreadyExists(err) {
		return nil // the watch brings it
	}
	if err != nil {
		return err
	}
	return n.report(ctx, made, rec)
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
	pod, err := n.pods.Pods(n.cfg.Namespace).Get(id)
	if err != nil || pod.Spec.NodeName != n.cfg.NodeName {
		pod, err = n.client.CoreV1().Pods(n.cfg.Namespace).Get(ctx, id, metav1.GetOptions{})
	}
	if apierrors.IsNotFound(err) {
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
func (n *Node) poolReady(req manager.CreateRequest) bool {
	if n.cfg.Host == nil {
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

// report writes a live sandbox's state into its pod: the annotations
// (end, state) and the status (Running), each only when it differs.
func (n *Node) report(ctx context.Context, pod *corev1.Pod, rec *store.Sandbox) error {
	pods := n.client.CoreV1().Pods(n.cfg.Namespace)
	end, state := FormatEnd(rec.EndAt), rec.State
	// What this node last wrote into this pod (its UID: a pod of the same
	// name made again is another) makes a stale copy from the watch cost
	// no request.
	written := string(pod.UID) + "|" + end + "|" + state
	n.mu.Lock()
	same := n.reported[pod.Name] == written
	n.mu.Unlock()
	if same {
		return nil
	}
	if pod.Status.Phase != corev1.PodRunning {
		// One request: the status, and the annotations with it (a pod's
		// status update keeps metadata changes; the patch below covers
		// an API server that would not).
		p := pod.DeepCopy()
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		p.Annotations[AnnoEnd], p.Annotations[AnnoState] = end, state
		p.Status = runningStatus(rec, n.cfg.Advertise)
		up, err := pods.UpdateStatus(ctx, p, metav1.UpdateOptions{})
		if err != nil {
			return err
		}
		pod = up
	}
	if pod.Annotations[AnnoEnd] != end || pod.Annotations[AnnoState] != state {
		patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{
			"annotations": map[string]string{AnnoEnd: end, AnnoState: state}}})
		if _, err := pods.Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			return err
		}
	}
	n.mu.Lock()
	n.reported[pod.Name] = written
	n.mu.Unlock()
	return nil
}

// runningStatus is the status of a pod whose sandbox rec runs on the node
// at ip.
func runningStatus(rec *store.Sandbox, ip string) corev1.PodStatus {
	started := metav1.NewTime(rec.StartedAt)
	now := metav1.Now()
	st := corev1.PodStatus{Phase: corev1.PodRunning, HostIP: ip, PodIP: ip,
		HostIPs: []corev1.HostIP{{IP: ip}}, PodIPs: []corev1.PodIP{{IP: ip}},
		StartTime: &started, QOSClass: corev1.PodQOSGuaranteed}
	for _, t := range []corev1.PodConditionType{corev1.PodScheduled, corev1.PodInitialized, corev1.ContainersReady, corev1.PodReady} {
		st.Conditions = append(st.Conditions, corev1.PodCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: now})
	}
	st.ContainerStatuses = []corev1.ContainerStatus{{Name: ContainerName, Ready: true, Started: ptrTrue(),
		Image: "cage.dev/template/" + rec.TemplateID, ImageID: "cage.dev/template/" + rec.TemplateID,
		ContainerID: "cage://" + rec.ID, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: started}}}}
	return st
}

func ptrTrue() *bool { t := true; return &t }

// fail reports pod Failed with reason and a one-line message.
func (n *Node) fail(ctx context.Context, pod *corev1.Pod, reason, msg string) error {
	if pod.Status.Phase == corev1.PodFailed {
		return nil
	}
	p := pod.DeepCopy()
	now := metav1.Now()
	p.Status.Phase, p.Status.Reason, p.Status.Message = corev1.PodFailed, reason, oneLine(msg)
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionFalse, Reason: reason,
		LastTransitionTime: now}}
	p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: ContainerName, State: corev1.ContainerState{
		Terminated: &corev1.ContainerStateTerminated{ExitCode: 1, Reason: reason, Message: oneLine(msg), FinishedAt: now}}}}
	_, err := n.client.CoreV1().Pods(n.cfg.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
	if err == nil {
		n.queue.AddAfter(pod.Name, n.cfg.Retention+time.Second)
		n.event(pod, corev1.EventTypeWarning, reason, msg)
	}
	return err
}

// event records a Kubernetes Event about pod, in the background (a
// failure to record it is logged, never the pod's failure).
func (n *Node) event(pod *corev1.Pod, typ, reason, msg string) {
	now := metav1.Now()
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{GenerateName: pod.Name + ".", Namespace: n.cfg.Namespace},
		InvolvedObject: corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: n.cfg.Namespace, Name: pod.Name,
			UID: pod.UID, FieldPath: "spec.containers{" + ContainerName + "}"},
		Reason: reason, Message: oneLine(msg), Type: typ, Count: 1, FirstTimestamp: now, LastTimestamp: now,
		Source: corev1.EventSource{Component: "cage", Host: n.cfg.NodeName}, ReportingController: "cage.dev/node",
		ReportingInstance: n.cfg.NodeName,
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := n.client.CoreV1().Events(n.cfg.Namespace).Create(ctx, ev, metav1.CreateOptions{}); err != nil {
			n.log.Debug("cluster: event", "pod", pod.Name, "err", err)
		}
	}()
}

// createFailed reports pod Failed (CreateFailed) for err, which every
// later start of it answers: a pod's create is tried once.
func (n *Node) createFailed(_ context.Context, pod *corev1.Pod, err error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // the create's may be spent
	defer cancel()
	n.mu.Lock()
	n.failed[pod.Name] = err
	n.mu.Unlock()
	if ferr := n.fail(ctx, pod, ReasonCreateFailed, err.Error()); ferr != nil && !apierrors.IsNotFound(ferr) {
		n.log.Warn("cluster: pod status", "pod", pod.Name, "err", ferr)
	}
	return err
}

// failedAt is when a Failed pod failed (its Ready condition's change).
func failedAt(pod *corev1.Pod) time.Time {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.LastTransitionTime.Time
		}
	}
	return time.Time{}
}

// deletePod deletes a pod now (grace 0), as a kubelet confirms a deletion.
// Once deleted, the pod's later syncs (until the watch sees it gone) cost
// no request.
func (n *Node) deletePod(ctx context.Context, pod *corev1.Pod) error {
	n.mu.Lock()
	done := n.deleted[pod.Name] == pod.UID
	n.mu.Unlock()
	if done {
		return nil
	}
	zero := int64(0)
	uid := pod.UID
	err := n.client.CoreV1().Pods(n.cfg.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: &zero, Preconditions: &metav1.Preconditions{UID: &uid}})
	if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
		err = nil
	}
	if err == nil {
		n.mu.Lock()
		n.deleted[pod.Name] = uid
		n.mu.Unlock()
	}
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
			n.mu.Unlock()
			if creating {
				continue
			}
			if _, err := n.pods.Pods(n.cfg.Namespace).Get(rec.ID); apierrors.IsNotFound(err) {
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
	pods, _ := n.pods.Pods(n.cfg.Namespace).List(everything)
	for _, p := range pods {
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
		if _, err := Verify(r, n.key); err != nil {
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
	rec, err := n.start(r.Context(), r.PathValue("name"), r.URL.Query().Get("pool") == "1")
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

var everything = labels.Everything()
