package kube

import (
	"context"
	"encoding/json"
	"fmt"
	"io"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// EventType is a watch event's type.
type EventType string

// The watch events.
const (
	Added    EventType = "ADDED"
	Modified EventType = "MODIFIED"
	Deleted  EventType = "DELETED"
	Bookmark EventType = "BOOKMARK"
	Error    EventType = "ERROR"
)

// Event is one event of a watch: Object is a *T (only its
// resourceVersion for a Bookmark), or a *metav1.Status for an Error.
type Event struct {
	Type   EventType
	Object any
}

// Watch is a watch in progress.
type Watch struct {
	ch     chan Event
	cancel context.CancelFunc
	err    error
}

// ResultChan is the watch's events; it is closed when the watch ends.
func (w *Watch) ResultChan() <-chan Event { return w.ch }

// Stop ends the watch.
func (w *Watch) Stop() { w.cancel() }

// Err is why the watch ended (nil: the server ended it, or Stop), once
// ResultChan is closed.
func (w *Watch) Err() error { return w.err }

// Watch watches the objects that o's selectors select, from
// o.ResourceVersion.
func (r Resource[T, L]) Watch(ctx context.Context, o metav1.ListOptions) (*Watch, error) {
	o.Watch = true
	ctx, cancel := context.WithCancel(ctx)
	resp, err := r.c.send(ctx, request{method: "GET", path: r.path(""), query: listQuery(o)})
	if err != nil {
		cancel()
		return nil, err
	}
	w := &Watch{ch: make(chan Event), cancel: cancel}
	go func() {
		defer close(w.ch)
		defer resp.Body.Close()
		defer cancel()
		dec := json.NewDecoder(resp.Body)
		for {
			var raw struct {
				Type   EventType       `json:"type"`
				Object json.RawMessage `json:"object"`
			}
			if err := dec.Decode(&raw); err != nil {
				if err != io.EOF && ctx.Err() == nil {
					w.err = err
				}
				return
			}
			ev := Event{Type: raw.Type}
			if raw.Type == Error {
				st := &metav1.Status{}
				if err := json.Unmarshal(raw.Object, st); err != nil {
					w.err = fmt.Errorf("kube: watch: malformed error event: %w", err)
					return
				}
				ev.Object = st
			} else {
				obj := new(T)
				if err := json.Unmarshal(raw.Object, obj); err != nil {
					w.err = fmt.Errorf("kube: watch: malformed %s event: %w", raw.Type, err)
					return
				}
				ev.Object = obj
			}
			select {
			case w.ch <- ev:
			case <-ctx.Done():
				return
			}
		}
	}()
	return w, nil
}
