package kube

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Elector takes part in the election of one Lease: it acquires the Lease
// when it is free or its holder's term has run out (LeaseDuration from
// when this elector last saw the holder's record change, on this host's
// clock), renews it every RetryPeriod while it leads, writing through the
// Lease's resourceVersion (a conflicting write loses), and stops leading
// when it has not renewed within RenewDeadline.
type Elector struct {
	Leases        Resource[coordinationv1.Lease, coordinationv1.LeaseList]
	Name          string // the Lease's
	Identity      string // this candidate's
	LeaseDuration time.Duration
	RenewDeadline time.Duration
	RetryPeriod   time.Duration
	// ReleaseOnCancel frees the Lease when ctx ends while leading, so
	// that another candidate takes it at once.
	ReleaseOnCancel bool

	observed     coordinationv1.LeaseSpec
	observedAt   time.Time
	observedLive bool
	mine         *coordinationv1.Lease // the Lease as this elector last wrote it
}

// Run stands until ctx ends: once elected it calls lead with a context
// that ends when leadership is lost (or ctx ends), and returns after lead
// has returned and the term has ended. Run again to stand again.
func (e *Elector) Run(ctx context.Context, lead func(ctx context.Context)) error {
	if e.LeaseDuration <= e.RenewDeadline || e.RenewDeadline <= e.RetryPeriod || e.RetryPeriod <= 0 {
		return errors.New("kube: election: need LeaseDuration > RenewDeadline > RetryPeriod > 0")
	}
	e.mine = nil
	if !e.acquire(ctx) {
		return nil
	}
	lctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); lead(lctx) }()
	e.renew(ctx)
	cancel()
	<-done
	if e.ReleaseOnCancel && ctx.Err() != nil {
		rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), e.RetryPeriod)
		e.release(rctx)
		rcancel()
	}
	return nil
}

// acquire tries every RetryPeriod (with jitter) until elected (true) or
// ctx ends.
func (e *Elector) acquire(ctx context.Context) bool {
	for {
		if e.try(ctx) {
			return true
		}
		t := time.NewTimer(e.RetryPeriod + rand.N(e.RetryPeriod/5+1))
		select {
		case <-ctx.Done():
			t.Stop()
			return false
		case <-t.C:
		}
	}
}

// renew renews every RetryPeriod and returns once a renewal has not
// succeeded within RenewDeadline, or ctx ends.
func (e *Elector) renew(ctx context.Context) {
	t := time.NewTicker(e.RetryPeriod)
	defer t.Stop()
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		dctx, cancel := context.WithDeadline(ctx, last.Add(e.RenewDeadline))
		ok := e.try(dctx)
		cancel()
		if ok {
			last = time.Now()
		} else if time.Since(last) >= e.RenewDeadline || ctx.Err() != nil {
			return
		}
	}
}

// try acquires or renews the Lease once.
func (e *Elector) try(ctx context.Context) bool {
	now := time.Now()
	mt := metav1.NewMicroTime(now)
	secs := int32(e.LeaseDuration / time.Second)
	if m := e.mine; m != nil && e.observedAt.Add(e.LeaseDuration).After(now) {
		// Leading: renew the Lease as last written, without reading it
		// first (a write since is a conflict, and the slow path reads).
		l := m.DeepCopy()
		l.Spec.RenewTime = &mt
		if up, err := e.Leases.Update(ctx, l, metav1.UpdateOptions{}); err == nil {
			e.observe(up.Spec, now)
			e.mine = up
			return true
		}
		e.mine = nil
	}
	l, err := e.Leases.Get(ctx, e.Name, metav1.GetOptions{})
	if IsNotFound(err) {
		l = &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: e.Name, Namespace: e.Leases.ns},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: &e.Identity, LeaseDurationSeconds: &secs,
				AcquireTime: &mt, RenewTime: &mt, LeaseTransitions: new(int32)}}
		made, err := e.Leases.Create(ctx, l, metav1.CreateOptions{})
		if err != nil {
			return false
		}
		e.observe(made.Spec, now)
		e.mine = made
		return true
	}
	if err != nil {
		return false
	}
	e.observe(l.Spec, now)
	holder := deref(l.Spec.HolderIdentity)
	if holder != "" && holder != e.Identity {
		d := e.LeaseDuration
		if l.Spec.LeaseDurationSeconds != nil {
			d = time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second
		}
		if e.observedAt.Add(d).After(now) {
			return false // another's term runs
		}
	}
	spec := l.Spec
	if holder != e.Identity {
		n := int32(0)
		if spec.LeaseTransitions != nil {
			n = *spec.LeaseTransitions
		}
		n++
		spec.LeaseTransitions, spec.AcquireTime = &n, &mt
	}
	spec.HolderIdentity, spec.LeaseDurationSeconds, spec.RenewTime = &e.Identity, &secs, &mt
	l.Spec = spec
	up, err := e.Leases.Update(ctx, l, metav1.UpdateOptions{})
	if err != nil {
		return false
	}
	e.observe(up.Spec, now)
	e.mine = up
	return true
}

// observe notes the Lease's record, and when it last changed.
func (e *Elector) observe(s coordinationv1.LeaseSpec, now time.Time) {
	if !e.observedLive || deref(s.HolderIdentity) != deref(e.observed.HolderIdentity) ||
		!microEqual(s.RenewTime, e.observed.RenewTime) {
		e.observed, e.observedAt, e.observedLive = s, now, true
	}
}

// release frees the Lease if this elector holds it.
func (e *Elector) release(ctx context.Context) {
	l, err := e.Leases.Get(ctx, e.Name, metav1.GetOptions{})
	if err != nil || deref(l.Spec.HolderIdentity) != e.Identity {
		return
	}
	mt := metav1.NewMicroTime(time.Now())
	one, empty := int32(1), ""
	l.Spec.HolderIdentity, l.Spec.LeaseDurationSeconds, l.Spec.RenewTime = &empty, &one, &mt
	_, _ = e.Leases.Update(ctx, l, metav1.UpdateOptions{})
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func microEqual(a, b *metav1.MicroTime) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Equal(b)
}

// RetryOnConflict calls f until it returns anything but a Conflict,
// at most 5 times, waiting about 10 ms between tries (client-go's
// retry.DefaultBackoff: 5 steps of 10 ms, jitter 0.1).
func RetryOnConflict(f func() error) error {
	var err error
	for i := range 5 {
		if i > 0 {
			time.Sleep(10*time.Millisecond + rand.N(time.Millisecond))
		}
		if err = f(); !IsConflict(err) {
			return err
		}
	}
	return err
}
