package cluster

// The node's writes to its pods: status, events, deletion.

import (
	"context"
	"encoding/json"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/cagehq/cage/internal/kube"
	"github.com/cagehq/cage/internal/store"
)

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
	if pod.Annotations[AnnoState] == state && pod.Annotations[AnnoEnd] != end {
		// Only the end moved (a timeout call): written at most once per
		// endEvery, the latest then; each write is a whole pod in etcd's
		// history, and a key's timeout calls are a thousand a second.
		n.mu.Lock()
		wait := endEvery - time.Since(n.endAt[pod.Name])
		if wait <= 0 {
			n.endAt[pod.Name] = time.Now()
		}
		n.mu.Unlock()
		if wait > 0 {
			n.queue.AddAfter(pod.Name, wait)
			return nil
		}
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

// endEvery is how often a sandbox's pod takes a change of its end alone
// (report). Measured before (a review, 2026-12-04): 300 timeout calls on
// one sandbox were 42 writes of its pod, 8 MB of etcd history with a
// spec of 240 KiB.
const endEvery = 5 * time.Second

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
	if ferr := n.fail(ctx, pod, ReasonCreateFailed, err.Error()); ferr != nil && !kube.IsNotFound(ferr) {
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
	if kube.IsNotFound(err) || kube.IsConflict(err) {
		err = nil
	}
	if err == nil {
		n.mu.Lock()
		n.deleted[pod.Name] = uid
		n.mu.Unlock()
	}
	return err
}
