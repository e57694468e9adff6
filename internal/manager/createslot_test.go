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
	m := New(Config{MaxCreating: slots})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var releases []func()
	for i := 0; i < slots; i++ {
		release, err := m.createSlot(ctx, "one")
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
			release, err := m.createSlot(ctx, "one")
			results <- result{release, err}
		}()
	}
	started.Wait()
	for _, w := m.slots.load(); w < waiting; _, w = m.slots.load() {
		select {
		case r := <-results:
			t.Fatalf("a create within the queue's bound did not wait: %v", r.err)
		default:
		}
	}
	if _, err := m.createSlot(ctx, "one"); !errors.Is(err, ErrLimit) {
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
	if inUse, waiting := m.slots.load(); inUse != 0 || waiting != 0 {
		t.Errorf("%d slots still taken and %d creates counted as waiting after every create gave its slot back", inUse, waiting)
	}
}

// TestCreateSlotsShared: one owner's burst holds every slot and every
// waiting place. Another owner's create is not refused: it takes the
// newest waiting place of the owner holding the most (that create is
// refused with ErrLimit), and the next slot given back goes to it, ahead
// of the first owner's earlier waiting creates. Before, the slots were one
// FIFO: the other owner got 429 until the burst drained. Found by review,
// 2026-12-03.
func TestCreateSlotsShared(t *testing.T) {
	const slots = 2
	m := New(Config{MaxCreating: slots})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var releases []func()
	for range slots {
		release, err := m.createSlot(ctx, "burst")
		if err != nil {
			t.Fatal(err)
		}
		releases = append(releases, release)
	}
	waiting := waitFactor * slots
	type result struct {
		owner   string
		i       int
		release func()
		err     error
	}
	results := make(chan result, waiting+4)
	enqueue := func(owner string, i int) {
		go func() {
			release, err := m.createSlot(ctx, owner)
			results <- result{owner, i, release, err}
		}()
		for { // one at a time, so that the queue's order is known
			if _, w := m.slots.load(); w > i || (owner != "burst" && w >= waiting) {
				return
			}
			select {
			case r := <-results:
				t.Fatalf("create %d of %s did not wait: %v", r.i, r.owner, r.err)
			default:
			}
		}
	}
	for i := range waiting {
		enqueue("burst", i)
	}
	if _, err := m.createSlot(ctx, "burst"); !errors.Is(err, ErrLimit) {
		t.Fatalf("the burst's create past every waiting place: %v, want ErrLimit", err)
	}
	// Another owner's create waits; the burst's newest is refused.
	go func() {
		release, err := m.createSlot(ctx, "other")
		results <- result{"other", 0, release, err}
	}()
	r := <-results
	if r.owner != "burst" || r.i != waiting-1 || !errors.Is(r.err, ErrLimit) {
		t.Fatalf("with every place taken, another owner's create came: %+v, want the burst's newest waiting create refused", r)
	}
	for _, w := m.slots.load(); w < waiting; _, w = m.slots.load() {
	}
	// The next slot goes to the other owner, ahead of the burst's waiting.
	releases[0]()
	r = <-results
	if r.owner != "other" || r.err != nil {
		t.Fatalf("the slot given back went to %+v, want the other owner's create", r)
	}
	r.release()
	r = <-results
	if r.owner != "burst" || r.i != 0 || r.err != nil {
		t.Fatalf("then: %+v, want the burst's first waiting create", r)
	}
	cancel() // every slot is taken: the others end with their requests
	for range waiting - 2 {
		if r := <-results; !errors.Is(r.err, context.Canceled) {
			t.Errorf("a waiting create whose request ended: %+v", r)
		}
	}
	r.release()
	releases[1]()
	if inUse, w := m.slots.load(); inUse != 0 || w != 0 {
		t.Errorf("%d slots taken and %d waiting at the end", inUse, w)
	}
}

// TestCreateSlotsOneOwnerWhole: a single owner's creates use every slot and
// every waiting place, as before the slots were shared.
func TestCreateSlotsOneOwnerWhole(t *testing.T) {
	const slots = 3
	m := New(Config{MaxCreating: slots})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for range slots {
		if _, err := m.createSlot(ctx, "solo"); err != nil {
			t.Fatal(err)
		}
	}
	errs := make(chan error, waitFactor*slots)
	for range waitFactor * slots {
		go func() { _, err := m.createSlot(ctx, "solo"); errs <- err }()
	}
	for _, w := m.slots.load(); w < waitFactor*slots; _, w = m.slots.load() {
		select {
		case err := <-errs:
			t.Fatalf("a create within the bounds did not wait: %v", err)
		default:
		}
	}
	if _, err := m.createSlot(ctx, "solo"); !errors.Is(err, ErrLimit) {
		t.Fatalf("past every place: %v, want ErrLimit", err)
	}
}
