package manager

import (
	"context"
	"errors"
	"sync"
	"testing"
)

// TestCreateSlotQueue: MaxCreating creates run, waitFactor times as many
// wait for a slot (a burst of 20 on a 2-core host queues), and the next is
// refused at once with ErrLimit; a slot given back goes to a waiting one.
func TestCreateSlotQueue(t *testing.T) {
	const slots = 2
	m := &Manager{cfg: Config{MaxCreating: slots}, createSlots: make(chan struct{}, slots)}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var releases []func()
	for i := 0; i < slots; i++ {
		release, err := m.createSlot(ctx)
		if err != nil {
			t.Fatalf("slot %d: %v", i, err)
		}
		releases = append(releases, release)
	}
	waiting := waitFactor * slots
	type result struct {
		release func()
		err     error
	}
	results := make(chan result, waiting)
	var started sync.WaitGroup
	for i := 0; i < waiting; i++ {
		started.Add(1)
		go func() {
			started.Done()
			release, err := m.createSlot(ctx)
			results <- result{release, err}
		}()
	}
	started.Wait()
	for m.waiting.Load() < int64(waiting) {
		select {
		case r := <-results:
			t.Fatalf("a create within the queue's bound did not wait: %v", r.err)
		default:
		}
	}
	if _, err := m.createSlot(ctx); !errors.Is(err, ErrLimit) {
		t.Fatalf("create %d with %d running and %d waiting: %v, want ErrLimit", slots+waiting+1, slots, waiting, err)
	}
	releases[0]()
	r := <-results
	if r.err != nil {
		t.Fatalf("a waiting create given the freed slot: %v", r.err)
	}
	cancel() // every slot is taken: the others end with their requests
	for i := 0; i < waiting-1; i++ {
		if r := <-results; !errors.Is(r.err, context.Canceled) {
			t.Errorf("a waiting create whose request ended: %v, want context.Canceled", r.err)
		}
	}
	r.release()
	releases[1]()
	if len(m.createSlots) != 0 {
		t.Errorf("%d slots still taken after every create gave its slot back", len(m.createSlots))
	}
	if n := m.waiting.Load(); n != 0 {
		t.Errorf("%d creates still counted as waiting", n)
	}
}
