package kube

import (
	"sync"
	"time"
)

// Queue is a work queue of keys, as a controller's: a key added while
// queued is queued once; a key being worked on (between Get and Done) is
// never handed to a second worker, and one added meanwhile is queued
// again at Done. AddRateLimited queues a key again after a delay that
// doubles with each failure (5 ms to 1000 s) until Forget.
type Queue struct {
	mu         sync.Mutex
	cond       *sync.Cond
	items      []string
	dirty      map[string]bool
	processing map[string]bool
	failures   map[string]int
	shutdown   bool
}

// NewQueue returns an empty queue.
func NewQueue() *Queue {
	q := &Queue{dirty: map[string]bool{}, processing: map[string]bool{}, failures: map[string]int{}}
	q.cond = sync.NewCond(&q.mu)
	return q
}

// Add queues key.
func (q *Queue) Add(key string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.shutdown || q.dirty[key] {
		return
	}
	q.dirty[key] = true
	if q.processing[key] {
		return // queued at Done
	}
	q.items = append(q.items, key)
	q.cond.Signal()
}

// AddAfter queues key after d.
func (q *Queue) AddAfter(key string, d time.Duration) {
	if d <= 0 {
		q.Add(key)
		return
	}
	time.AfterFunc(d, func() { q.Add(key) })
}

// AddRateLimited queues key again after its failures' delay.
func (q *Queue) AddRateLimited(key string) {
	q.mu.Lock()
	n := q.failures[key]
	q.failures[key] = n + 1
	q.mu.Unlock()
	d := 5 * time.Millisecond
	for ; n > 0 && d < 1000*time.Second; n-- {
		d *= 2
	}
	q.AddAfter(key, min(d, 1000*time.Second))
}

// Forget clears key's failures.
func (q *Queue) Forget(key string) {
	q.mu.Lock()
	delete(q.failures, key)
	q.mu.Unlock()
}

// Get waits for a key; quit once the queue is shut down.
func (q *Queue) Get() (key string, quit bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.items) == 0 && !q.shutdown {
		q.cond.Wait()
	}
	if len(q.items) == 0 {
		return "", true
	}
	key, q.items = q.items[0], q.items[1:]
	q.processing[key] = true
	delete(q.dirty, key)
	return key, false
}

// Done ends the work on key (queuing it again if it was added meanwhile).
func (q *Queue) Done(key string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	delete(q.processing, key)
	if q.dirty[key] {
		q.items = append(q.items, key)
		q.cond.Signal()
	}
}

// ShutDown ends every Get; later adds are dropped.
func (q *Queue) ShutDown() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.shutdown = true
	q.cond.Broadcast()
}

// Len is the number of keys queued.
func (q *Queue) Len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.items)
}
