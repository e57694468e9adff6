package manager

import (
	"context"
	"fmt"
	"sync"
)

// Create slots: at most MaxCreating creates (and resumes that start a
// sandbox) in progress, and waitFactor times as many waiting. They are
// shared by every owner (a team, or a key without one), fairly where
// owners contend for them and whole where one is alone:
//
//   - a slot given back goes to the waiting create whose owner holds the
//     fewest slots (the earliest of those), so an owner with many creates
//     in progress does not keep another's first create waiting behind
//     them all;
//   - a create that finds every waiting place taken takes the newest
//     place of the owner that holds the most, when that owner holds at
//     least two more than the create's own owner (that create is refused
//     with ErrLimit, as it would have been had it come last); else it is
//     refused.
//
// A single tenant's creates are served first come, first served with
// every slot and waiting place, as before. Found by review, 2026-12-03:
// the slots were one FIFO, so one tenant's burst filled every slot and
// waiting place and other tenants' creates got 429 until it drained.

// waitFactor is how many creates may wait for a slot, per slot: a waiting
// create costs a goroutine and its request, and a burst of a few dozen
// (an SDK's users start 20 at once) must queue on a 2-core host rather
// than fail.
const waitFactor = 8

// createSlots is the slots and their waiting places.
type createSlots struct {
	mu      sync.Mutex
	max     int            // slots
	maxWait int            // waiting places
	inUse   int            // slots held
	held    map[string]int // slots held, by owner
	waits   map[string]int // waiting places held, by owner
	queue   []*slotWaiter  // waiting creates, in arrival order
}

// slotWaiter is one waiting create: its grant is sent nil when it is
// given a slot, or an error when its place went to another owner's create.
type slotWaiter struct {
	owner string
	grant chan error // buffered: the sender never waits
}

func newCreateSlots(n int) *createSlots {
	return &createSlots{max: n, maxWait: waitFactor * n, held: map[string]int{}, waits: map[string]int{}}
}

// acquire waits for a slot for owner; with every waiting place taken it
// refuses at once (or takes the place of the owner holding the most).
func (s *createSlots) acquire(ctx context.Context, owner string) (release func(), err error) {
	release = func() { s.release(owner) }
	s.mu.Lock()
	if s.inUse < s.max && len(s.queue) == 0 {
		s.take(owner)
		s.mu.Unlock()
		return release, nil
	}
	if len(s.queue) >= s.maxWait && !s.bump(owner) {
		s.mu.Unlock()
		return nil, fmt.Errorf("%w: %d creates are in progress and %d wait; try again", ErrLimit, s.max, s.maxWait)
	}
	w := &slotWaiter{owner: owner, grant: make(chan error, 1)}
	s.queue = append(s.queue, w)
	s.waits[owner]++
	s.mu.Unlock()
	select {
	case err := <-w.grant:
		if err != nil {
			return nil, err
		}
		return release, nil
	case <-ctx.Done():
	}
	s.mu.Lock()
	if s.remove(w) {
		s.mu.Unlock()
		return nil, ctx.Err()
	}
	s.mu.Unlock()
	if err := <-w.grant; err == nil { // granted as the request ended: give it back
		release()
	}
	return nil, ctx.Err()
}

// take gives owner a slot (s.mu held).
func (s *createSlots) take(owner string) {
	s.inUse++
	s.held[owner]++
}

// release gives owner's slot back and hands free slots to the waiting.
func (s *createSlots) release(owner string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inUse--
	if s.held[owner]--; s.held[owner] <= 0 {
		delete(s.held, owner)
	}
	for s.inUse < s.max && len(s.queue) > 0 {
		next := 0
		for i, w := range s.queue {
			if s.held[w.owner] < s.held[s.queue[next].owner] {
				next = i
			}
		}
		w := s.queue[next]
		s.remove(w)
		s.take(w.owner)
		w.grant <- nil
	}
}

// bump frees a waiting place for owner's create by refusing the newest
// waiting create of the owner holding the most places, when that owner
// holds at least two more than owner (s.mu held).
func (s *createSlots) bump(owner string) bool {
	top := ""
	for o, n := range s.waits {
		if n > s.waits[top] || top == "" {
			top = o
		}
	}
	if top == "" || s.waits[top] < s.waits[owner]+2 {
		return false
	}
	for i := len(s.queue) - 1; i >= 0; i-- {
		if w := s.queue[i]; w.owner == top {
			s.remove(w)
			w.grant <- fmt.Errorf("%w: %d creates are in progress and %d wait, %d of them this owner's; try again", ErrLimit, s.max, s.maxWait, s.waits[top]+1)
			return true
		}
	}
	return false
}

// remove takes w out of the queue; false when it is not there (s.mu held).
func (s *createSlots) remove(w *slotWaiter) bool {
	for i, q := range s.queue {
		if q == w {
			s.queue = append(s.queue[:i], s.queue[i+1:]...)
			if s.waits[w.owner]--; s.waits[w.owner] <= 0 {
				delete(s.waits, w.owner)
			}
			return true
		}
	}
	return false
}

// load is the slots held and the creates waiting.
func (s *createSlots) load() (inUse, waiting int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inUse, len(s.queue)
}

// createSlot waits for one of the MaxCreating slots for owner's create
// or resume (see createSlots).
func (m *Manager) createSlot(ctx context.Context, owner string) (release func(), err error) {
	return m.slots.acquire(ctx, owner)
}
