package kube

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// object is what the informer needs of an object (metav1.ObjectMeta's).
type object interface {
	GetName() string
	GetResourceVersion() string
}

// Handlers are told of an informer's changes, in order, from its
// goroutine (so each must be quick), after its cache has the change. A
// relist (the first list, a watch too old to resume) reports each object
// as added or updated and each gone one as deleted.
type Handlers[T any] struct {
	Add    func(obj *T)
	Update func(old, obj *T)
	Delete func(obj *T) // its last state known
}

// Informer keeps a cache of the objects of one resource that a list's
// selectors select, by list and then watch from the list's
// resourceVersion, watching again from the last one seen when a watch
// ends and listing again when that is too old (410) or the watch fails.
// Objects are keyed by name: an informer watches one namespace, or a
// cluster-scoped resource. Objects it hands out are shared: read only.
type Informer[T any, L any] struct {
	res      Resource[T, L]
	opts     metav1.ListOptions
	handlers []Handlers[T]
	mu       sync.RWMutex
	items    map[string]*T
	synced   atomic.Bool
	lists    atomic.Int64 // lists made (tests)
}

// NewInformer returns an informer of res's objects that opts' label and
// field selectors select; Start runs it.
func NewInformer[T any, L any](res Resource[T, L], opts metav1.ListOptions) *Informer[T, L] {
	return &Informer[T, L]{res: res, opts: metav1.ListOptions{LabelSelector: opts.LabelSelector, FieldSelector: opts.FieldSelector},
		items: map[string]*T{}}
}

// AddHandlers adds h (before Start).
func (i *Informer[T, L]) AddHandlers(h Handlers[T]) { i.handlers = append(i.handlers, h) }

// Start runs the informer until ctx ends.
func (i *Informer[T, L]) Start(ctx context.Context) { go i.run(ctx) }

// HasSynced says whether the first list is in the cache and its
// handlers called.
func (i *Informer[T, L]) HasSynced() bool { return i.synced.Load() }

// Lists is how many lists the informer has made.
func (i *Informer[T, L]) Lists() int64 { return i.lists.Load() }

// Get returns the named object of the cache, or a NotFound error.
func (i *Informer[T, L]) Get(name string) (*T, error) {
	i.mu.RLock()
	o, ok := i.items[name]
	i.mu.RUnlock()
	if !ok {
		return nil, NewNotFound(i.res.name, name)
	}
	return o, nil
}

// List returns the cache's objects, in no order.
func (i *Informer[T, L]) List() []*T {
	i.mu.RLock()
	defer i.mu.RUnlock()
	out := make([]*T, 0, len(i.items))
	for _, o := range i.items {
		out = append(out, o)
	}
	return out
}

// WaitForSync waits until each of synced says so (true) or ctx ends (false).
func WaitForSync(ctx context.Context, synced ...func() bool) bool {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		all := true
		for _, s := range synced {
			all = all && s()
		}
		if all {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
		}
	}
}

var errShortWatch = errors.New("kube: the watch ended at once with no event")

// backoff is the wait before listing again after a failure: 0.8 s
// doubling to 30 s, with jitter (client-go's reflector's).
type backoff struct{ d time.Duration }

func (b *backoff) sleep(ctx context.Context) {
	b.d = min(max(b.d*2, 800*time.Millisecond), 30*time.Second)
	t := time.NewTimer(b.d + rand.N(b.d/2))
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

func (i *Informer[T, L]) run(ctx context.Context) {
	var b backoff
	for ctx.Err() == nil {
		rv, err := i.list(ctx)
		if err != nil {
			b.sleep(ctx)
			continue
		}
		for ctx.Err() == nil {
			if rv, err = i.watch(ctx, rv); err != nil {
				break
			}
			b = backoff{} // a watch that ran to its end: the server is fine
		}
		if ctx.Err() == nil && !IsGone(err) {
			b.sleep(ctx)
		}
	}
}

// list replaces the cache with a list and returns its resourceVersion.
func (i *Informer[T, L]) list(ctx context.Context) (string, error) {
	i.lists.Add(1)
	var l struct {
		Metadata metav1.ListMeta `json:"metadata"`
		Items    []T             `json:"items"`
	}
	if err := i.res.c.call(ctx, request{method: "GET", path: i.res.path(""), query: listQuery(i.opts)}, &l); err != nil {
		return "", err
	}
	items := make(map[string]*T, len(l.Items))
	for k := range l.Items {
		items[any(&l.Items[k]).(object).GetName()] = &l.Items[k]
	}
	i.mu.Lock()
	old := i.items
	i.items = items
	i.mu.Unlock()
	for name, o := range items {
		if prev, ok := old[name]; ok {
			i.updated(prev, o)
		} else {
			i.added(o)
		}
	}
	for name, prev := range old {
		if _, ok := items[name]; !ok {
			i.deleted(prev)
		}
	}
	i.synced.Store(true)
	return l.Metadata.ResourceVersion, nil
}

// watch applies a watch from rv to the cache until it ends, and returns
// the last resourceVersion seen; nil error: the server ended it.
func (i *Informer[T, L]) watch(ctx context.Context, rv string) (_ string, err error) {
	o := i.opts
	o.ResourceVersion, o.AllowWatchBookmarks = rv, true
	secs := int64(300 + rand.N(300)) // 5 to 10 minutes, as client-go's
	o.TimeoutSeconds = &secs
	w, err := i.res.Watch(ctx, o)
	if err != nil {
		return rv, err
	}
	defer w.Stop()
	start, events := time.Now(), 0
	defer func() {
		// A watch the server ends at once with nothing in it (a proxy
		// that cuts streams) is a failure: list again after the backoff
		// rather than watch again at once, forever (client-go's "very
		// short watch").
		if err == nil && events == 0 && time.Since(start) < time.Second && ctx.Err() == nil {
			err = errShortWatch
		}
	}()
	for ev := range w.ResultChan() {
		events++
		if ev.Type == Error {
			return rv, &StatusError{Status: *ev.Object.(*metav1.Status)}
		}
		obj := ev.Object.(*T)
		m := any(obj).(object)
		if v := m.GetResourceVersion(); v != "" {
			rv = v
		}
		name := m.GetName()
		switch ev.Type {
		case Added, Modified:
			i.mu.Lock()
			prev, ok := i.items[name]
			i.items[name] = obj
			i.mu.Unlock()
			if ok {
				i.updated(prev, obj)
			} else {
				i.added(obj)
			}
		case Deleted:
			i.mu.Lock()
			delete(i.items, name)
			i.mu.Unlock()
			i.deleted(obj)
		}
	}
	return rv, w.Err()
}

func (i *Informer[T, L]) added(o *T) {
	for _, h := range i.handlers {
		if h.Add != nil {
			h.Add(o)
		}
	}
}

func (i *Informer[T, L]) updated(prev, o *T) {
	for _, h := range i.handlers {
		if h.Update != nil {
			h.Update(prev, o)
		}
	}
}

func (i *Informer[T, L]) deleted(o *T) {
	for _, h := range i.handlers {
		if h.Delete != nil {
			h.Delete(o)
		}
	}
}
