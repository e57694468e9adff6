package cluster

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cagehq/cage/internal/kube"
)

// LifecycleLease is the Lease (in the cage namespace) that elects the one
// cage serve that taints lost nodes.
const LifecycleLease = "cage-lifecycle"

// TaintUnreachable is the taint a lost node gets, as
// kube-controller-manager's node lifecycle would give it: kube-scheduler
// then sends creates to the other nodes.
const TaintUnreachable = "node.kubernetes.io/unreachable"

// TaintNotReady is the taint the API server's TaintNodesByCondition
// admission gives every new Node; kube-controller-manager would remove it
// once the node is Ready, and without one the lifecycle does, once the
// node's lease is live.
const TaintNotReady = "node.kubernetes.io/not-ready"

// RunLifecycle takes part in the election of LifecycleLease until ctx
// ends; while this node (identity) leads, every leaseDuration/4 it taints
// each cage Node whose Lease is stale (TaintUnreachable:NoSchedule, and
// condition Ready Unknown) and untaints it once its lease is renewed (and
// removes TaintNotReady from a new node with a live lease). Without
// kube-controller-manager, nothing else does.
func RunLifecycle(ctx context.Context, c *kube.Client, ns, identity string, leaseDuration time.Duration, log *slog.Logger) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	e := &kube.Elector{Leases: c.CoordinationV1().Leases(ns), Name: LifecycleLease, Identity: identity,
		LeaseDuration: leaseDuration, RenewDeadline: leaseDuration * 2 / 3, RetryPeriod: leaseDuration / 4,
		ReleaseOnCancel: true}
	for ctx.Err() == nil {
		err := e.Run(ctx, func(ctx context.Context) {
			log.Info("cluster: leading node lifecycle", "node", identity)
			watchLeases(ctx, c, leaseDuration, log)
		}) // returns when leadership is lost; stand again
		if err != nil {
			log.Error("cluster: node lifecycle election", "err", err)
			return
		}
	}
}

// watchLeases checks the nodes' leases every leaseDuration/4 until ctx ends.
func watchLeases(ctx context.Context, c *kube.Client, leaseDuration time.Duration, log *slog.Logger) {
	t := time.NewTicker(leaseDuration / 4)
	defer t.Stop()
	for {
		if err := CheckNodes(ctx, c, leaseDuration, time.Now()); err != nil && ctx.Err() == nil {
			log.Warn("cluster: node lifecycle", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// CheckNodes taints the cage Nodes whose lease has expired at now and
// untaints those whose lease is live (one pass).
func CheckNodes(ctx context.Context, c *kube.Client, leaseDuration time.Duration, now time.Time) error {
	nodes, err := c.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: NodeLabel + "=true"})
	if err != nil {
		return fmt.Errorf("list nodes: %w", err)
	}
	leases, err := c.CoordinationV1().Leases(NodeLeaseNamespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list leases: %w", err)
	}
	byName := map[string]*coordinationv1.Lease{}
	for i := range leases.Items {
		byName[leases.Items[i].Name] = &leases.Items[i]
	}
	var first error
	for i := range nodes.Items {
		n := &nodes.Items[i]
		// A node registers its Node a moment before it makes its Lease:
		// one younger than a lease duration is not lost for having none.
		l := byName[n.Name]
		stale := leaseExpired(l, leaseDuration, now) && (l != nil || now.Sub(n.CreationTimestamp.Time) > leaseDuration)
		if stale == hasTaint(n, TaintUnreachable) && (stale || !hasTaint(n, TaintNotReady)) {
			continue
		}
		if err := setUnreachable(ctx, c, n.Name, stale, now); err != nil && first == nil {
			first = fmt.Errorf("node %s: %w", n.Name, err)
		}
	}
	return first
}

// leaseExpired says whether a node's lease (nil: none) has run out at now.
func leaseExpired(l *coordinationv1.Lease, def time.Duration, now time.Time) bool {
	if l == nil || l.Spec.RenewTime == nil {
		return true
	}
	d := def
	if l.Spec.LeaseDurationSeconds != nil {
		d = time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second
	}
	return now.After(l.Spec.RenewTime.Add(d))
}

func hasTaint(n *corev1.Node, key string) bool {
	for _, t := range n.Spec.Taints {
		if t.Key == key {
			return true
		}
	}
	return false
}

// setUnreachable adds (on) or removes the unreachable taint of a node
// (removing the not-ready one too) and, when adding it, marks its Ready
// condition Unknown.
func setUnreachable(ctx context.Context, c *kube.Client, name string, on bool, now time.Time) error {
	nodes := c.CoreV1().Nodes()
	err := kube.RetryOnConflict(func() error {
		n, err := nodes.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		var taints []corev1.Taint
		for _, t := range n.Spec.Taints {
			if t.Key != TaintUnreachable && (on || t.Key != TaintNotReady) {
				taints = append(taints, t)
			}
		}
		if on {
			at := metav1.NewTime(now)
			taints = append(taints, corev1.Taint{Key: TaintUnreachable, Effect: corev1.TaintEffectNoSchedule, TimeAdded: &at})
		}
		n.Spec.Taints = taints
		_, err = nodes.Update(ctx, n, metav1.UpdateOptions{})
		return err
	})
	if err != nil || !on {
		return err
	}
	return kube.RetryOnConflict(func() error {
		n, err := nodes.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for i := range n.Status.Conditions {
			cond := &n.Status.Conditions[i]
			if cond.Type == corev1.NodeReady && cond.Status != corev1.ConditionUnknown {
				cond.Status, cond.Reason = corev1.ConditionUnknown, "NodeStatusUnknown"
				cond.Message = "cage stopped renewing the node's lease"
				cond.LastTransitionTime = metav1.NewTime(now)
			}
		}
		_, err = nodes.UpdateStatus(ctx, n, metav1.UpdateOptions{})
		if kube.IsNotFound(err) {
			return nil
		}
		return err
	})
}
