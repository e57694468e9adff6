package audit

import (
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// Limits bound what the trail keeps; zero fields take the defaults.
type Limits struct {
	// PerSandbox is how many entries of the kinds a tenant makes happen at
	// will (processes, files, envd calls, network decisions) one sandbox
	// keeps; beyond it they are counted, not kept (default 50,000).
	// Lifecycle entries are always kept.
	PerSandbox int64
	// KeyRate and KeyBurst bound the API-call entries of one key (default
	// 200 a second, bursts of 2,000); AnonRate and AnonBurst those of
	// requests without a valid credential, all together (default 50 a
	// second, bursts of 500).
	KeyRate   float64
	KeyBurst  int
	AnonRate  float64
	AnonBurst int
	// MaxAge and MaxBytes: retention (default 30 days, 1 GiB).
	MaxAge   time.Duration
	MaxBytes int64
	// Queue is how many entries wait for the writer at most (default
	// 16,384); beyond, entries are counted, not kept.
	Queue int
}

// DefaultLimits are what a zero field takes.
var DefaultLimits = Limits{PerSandbox: 50_000, KeyRate: 200, KeyBurst: 2000, AnonRate: 50, AnonBurst: 500,
	MaxAge: 30 * 24 * time.Hour, MaxBytes: 1 << 30, Queue: 16384}

func (l Limits) withDefaults() Limits {
	d := DefaultLimits
	if l.PerSandbox <= 0 {
		l.PerSandbox = d.PerSandbox
	}
	if l.KeyRate <= 0 {
		l.KeyRate = d.KeyRate
	}
	if l.KeyBurst <= 0 {
		l.KeyBurst = d.KeyBurst
	}
	if l.AnonRate <= 0 {
		l.AnonRate = d.AnonRate
	}
	if l.AnonBurst <= 0 {
		l.AnonBurst = d.AnonBurst
	}
	if l.MaxAge <= 0 {
		l.MaxAge = d.MaxAge
	}
	if l.MaxBytes <= 0 {
		l.MaxBytes = d.MaxBytes
	}
	if l.Queue <= 0 {
		l.Queue = d.Queue
	}
	return l
}

const (
	batchSize   = 1024
	tick        = 100 * time.Millisecond
	retainEvery = time.Minute
	// lifecycleWait is how long an entry that is always kept waits for
	// room in a full queue.
	lifecycleWait = time.Second
)

// Trail is the daemon's writer of the audit trail. Its methods are safe
// for concurrent use, and a nil *Trail records nothing.
type Trail struct {
	db    *DB
	lim   Limits
	log   *slog.Logger
	owner atomic.Pointer[func(sandboxID string) string]

	ch    chan Event
	flush chan chan struct{}
	stop  chan struct{}
	done  sync.WaitGroup

	mu      sync.Mutex
	buckets map[string]*bucket // API-call entries per key; "" is anonymous
	lost    map[string]int64   // entries not queued, per sandbox or "key:ID", "team:ID" or "anon"
	lostN   atomic.Int64

	w writerState // the writer goroutine's own

	endsMu   sync.Mutex
	ends     map[string]time.Time // processes whose end is recorded (envd.go)
	endsRing []string             // their keys, oldest overwritten
	endsNext int
}

// bucket is a token bucket.
type bucket struct {
	tokens float64
	last   time.Time
}

// Start starts a trail writing to db.
func Start(db *DB, lim Limits, log *slog.Logger) *Trail {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	lim = lim.withDefaults()
	t := &Trail{db: db, lim: lim, log: log, ch: make(chan Event, lim.Queue),
		flush: make(chan chan struct{}), stop: make(chan struct{}), buckets: map[string]*bucket{}, lost: map[string]int64{}}
	t.w = newWriterState()
	t.done.Add(2)
	go t.writer()
	go t.retainer()
	t.Record(Event{Kind: KindStart, Detail: map[string]any{"per_sandbox": lim.PerSandbox, "max_age": lim.MaxAge.String(),
		"max_bytes": lim.MaxBytes}})
	return t
}

// SetOwner gives the trail a way to name the key a sandbox belongs to, for
// entries recorded without one; the writer calls it, off every request's
// path.
func (t *Trail) SetOwner(owner func(sandboxID string) string) {
	if t != nil {
		t.owner.Store(&owner)
	}
}

// DB is the trail's database.
func (t *Trail) DB() *DB { return t.db }

// Limits are the trail's limits, defaults filled in.
func (t *Trail) Limits() Limits { return t.lim }

// Close writes what is queued and stops the trail's goroutines.
func (t *Trail) Close() {
	if t == nil {
		return
	}
	select {
	case <-t.stop:
		return
	default:
	}
	close(t.stop)
	t.done.Wait()
}

// Record queues an event. It never blocks on the database; an API call
// over its key's rate, or anything when the queue is full, is counted and
// not kept (lifecycle entries wait up to a second for room).
func (t *Trail) Record(ev Event) {
	if t == nil || ev.Kind == "" {
		return
	}
	if ev.Time.IsZero() {
		ev.Time = time.Now()
	}
	boundDetail(ev.Detail)
	// A sandbox id and a route come from a request's path: any caller's.
	if len(ev.SandboxID) > 64 {
		ev.SandboxID = ev.SandboxID[:64]
	}
	ev.Route = clipString(ev.Route)
	if family(ev.Kind) == "api" || family(ev.Kind) == "proxy" {
		// By owner: a key, else a team (a team's volume, reached with the
		// volume's token, names no key); the shared anonymous bucket is for
		// entries with no owner at all, which anyone can fill.
		owner := ev.KeyID
		if owner == "" {
			owner = ev.TeamID
		}
		if !t.allow(owner, ev.Time) {
			t.count(lostKey(ev))
			return
		}
	}
	select {
	case t.ch <- ev:
		return
	default:
	}
	if !capped(ev.Kind) && family(ev.Kind) != "api" && family(ev.Kind) != "proxy" {
		timer := time.NewTimer(lifecycleWait)
		defer timer.Stop()
		select {
		case t.ch <- ev:
			return
		case <-timer.C:
		case <-t.stop:
		}
	}
	t.count(lostKey(ev))
}

// lostKey is whose count an entry not kept goes to.
func lostKey(ev Event) string {
	switch {
	case ev.SandboxID != "" && ownedBySandbox(ev.Kind):
		return ev.SandboxID
	case ev.KeyID != "":
		return "key:" + ev.KeyID
	case ev.TeamID != "":
		return "team:" + ev.TeamID
	}
	return "anon"
}

func (t *Trail) count(k string) {
	t.mu.Lock()
	t.lost[k]++
	t.mu.Unlock()
	t.lostN.Add(1)
}

// allow takes a token from the owner's bucket (a key's or a team's; ""
// anonymous: the shared one).
func (t *Trail) allow(key string, now time.Time) bool {
	rate, burst := t.lim.KeyRate, t.lim.KeyBurst
	if key == "" {
		rate, burst = t.lim.AnonRate, t.lim.AnonBurst
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	b := t.buckets[key]
	if b == nil {
		b = &bucket{tokens: float64(burst), last: now}
		t.buckets[key] = b
	}
	b.tokens = min(float64(burst), b.tokens+now.Sub(b.last).Seconds()*rate)
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// Lost is how many entries were not queued since the trail started (over a
// rate, or the queue full).
func (t *Trail) Lost() int64 {
	if t == nil {
		return 0
	}
	return t.lostN.Load()
}

// Flush writes what is queued now, for a reader that wants what happened
// up to this moment (waiting at most two seconds).
func (t *Trail) Flush() {
	if t == nil {
		return
	}
	done := make(chan struct{})
	timer := time.NewTimer(2 * time.Second)
	defer timer.Stop()
	select {
	case t.flush <- done:
	case <-t.stop:
		return
	case <-timer.C:
		return
	}
	select {
	case <-done:
	case <-timer.C:
	}
}

// retainer applies retention now and then.
func (t *Trail) retainer() {
	defer t.done.Done()
	tk := time.NewTicker(retainEvery)
	defer tk.Stop()
	for {
		if n, err := t.db.Retain(t.lim.MaxAge, t.lim.MaxBytes); err != nil {
			t.log.Warn("audit: retention", "err", err)
		} else if n > 0 {
			t.log.Info("audit: retention", "removed", n)
			if err := t.db.compact(); err != nil {
				t.log.Warn("audit: retention", "err", err)
			}
		}
		select {
		case <-t.stop:
			return
		case <-tk.C:
		}
	}
}

// maxStringKept bounds each string an entry's detail keeps (a path, a
// cwd, a tag: a tenant chooses them, up to what a request can carry), and
// maxListKept each list (env names), so that a tenant cannot make every
// entry large and push others out of retention sooner. argv is bounded by
// its own rule (boundedArgv, 16 KiB in all, hashed).
const (
	maxStringKept = 4 << 10
	maxListKept   = 256
)

// boundDetail clips d's strings and lists in place; Record's caller gives
// the map up with the entry.
func boundDetail(d map[string]any) {
	for k, v := range d {
		switch v := v.(type) {
		case string:
			d[k] = clipString(v)
		case []string:
			if k == "argv" {
				continue
			}
			if len(v) > maxListKept {
				d[k+"_not_kept"] = len(v) - maxListKept
				v = v[:maxListKept]
			}
			for i := range v {
				v[i] = clipString(v[i])
			}
			d[k] = v
		case map[string]any:
			boundDetail(v)
		}
	}
}

func clipString(s string) string {
	if len(s) <= maxStringKept {
		return s
	}
	return s[:maxStringKept] + "…(truncated)"
}
