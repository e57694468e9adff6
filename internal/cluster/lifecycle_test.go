package cluster

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestLifecycle: the elected cage serve taints a node whose lease has
// expired (so kube-scheduler sends creates elsewhere) and marks it not
// Ready, and untaints it once its lease is renewed; a live node is left
// alone, and so is a Node registered less than a lease duration ago
// without a Lease yet (its node makes it a moment later).
func TestLifecycle(t *testing.T) {
	c := newPlane(t)
	key := nodeKey(t)
	addStandIn(t, c, key, "live", "process")
	addStandIn(t, c, key, "dying", "process")
	// A Node just registered, whose node has not made its Lease yet.
	if _, err := c.CoreV1().Nodes().Create(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "newborn",
		Labels: map[string]string{NodeLabel: "true"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.CoreV1().Nodes().Delete(context.Background(), "newborn", metav1.DeleteOptions{}) })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() { RunLifecycle(ctx, c, testNS, "live", 2*time.Second, nil); close(done) }()
	defer func() { cancel(); <-done }()
	renewLease(t, c, "dying", time.Now().Add(-time.Minute))
	stop := make(chan struct{})
	defer close(stop)
	go func() { // live keeps its lease
		for {
			select {
			case <-stop:
				return
			case <-time.After(500 * time.Millisecond):
				_ = setLease(c, "live", time.Now())
			}
		}
	}()
	node := func(name string) *corev1.Node {
		n, err := c.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	wait(t, func() bool { return hasTaint(node("dying"), TaintUnreachable) })
	wait(t, func() bool {
		for _, cond := range node("dying").Status.Conditions {
			if cond.Type == corev1.NodeReady {
				return cond.Status == corev1.ConditionUnknown
			}
		}
		return false
	})
	if hasTaint(node("live"), TaintUnreachable) {
		t.Fatal("a live node was tainted")
	}
	if hasTaint(node("newborn"), TaintUnreachable) {
		t.Fatal("a node registered a moment ago, its Lease not made yet, was tainted")
	}
	l, err := c.CoordinationV1().Leases(testNS).Get(ctx, LifecycleLease, metav1.GetOptions{})
	if err != nil || l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity != "live" {
		t.Fatalf("lifecycle lease: %+v %v", l, err)
	}
	// Still without a Lease a lease duration on: lost.
	wait(t, func() bool { return hasTaint(node("newborn"), TaintUnreachable) })
	renewLease(t, c, "dying", time.Now().Add(time.Minute)) // back (renewed "in the future": live for a while)
	wait(t, func() bool { return !hasTaint(node("dying"), TaintUnreachable) })
	// New nodes' not-ready taint (TaintNodesByCondition) is gone from
	// nodes with a live lease: the scheduler may use them.
	if hasTaint(node("live"), TaintNotReady) {
		t.Fatal("a live node keeps the not-ready taint")
	}
}
