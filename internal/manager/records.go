package manager

import (
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/store"
)

// Network records (every allowed and denied connection and DNS answer of a
// sandbox) come in floods the sandbox controls. They never reach the store
// on the caller's path: NetRecord (called by the network's resolver and log
// reader) checks the sandbox's rate and queues; one goroutine writes the
// queue in batches to the records database (store.Records, a file of its
// own), keeping at most PerSandbox records of each sandbox; every record
// not kept (over the rate, over the cap, the queue full) is counted, per
// sandbox, and the count is served with the records. Another goroutine
// deletes records (and audit events) past their age and the oldest records
// beyond the database's size.

// RecordLimits bound the network records; zero fields take the defaults.
type RecordLimits struct {
	Rate       float64       // records a second per sandbox (default 20)
	Burst      int           // records at once per sandbox (default 200)
	PerSandbox int64         // records kept per sandbox (default 10,000)
	MaxAge     time.Duration // records and audit events older are deleted (default 7 days)
	MaxBytes   int64         // the records' size in their database (default 256 MiB)
}

// DefaultRecordLimits are the limits a zero field takes.
var DefaultRecordLimits = RecordLimits{Rate: 20, Burst: 200, PerSandbox: 10_000, MaxAge: 7 * 24 * time.Hour, MaxBytes: 256 << 20}

func (l RecordLimits) withDefaults() RecordLimits {
	d := DefaultRecordLimits
	if l.Rate <= 0 {
		l.Rate = d.Rate
	}
	if l.Burst <= 0 {
		l.Burst = d.Burst
	}
	if l.PerSandbox <= 0 {
		l.PerSandbox = d.PerSandbox
	}
	if l.MaxAge <= 0 {
		l.MaxAge = d.MaxAge
	}
	if l.MaxBytes <= 0 {
		l.MaxBytes = d.MaxBytes
	}
	return l
}

const (
	recordQueue = 4096
	recordBatch = 512
	recordTick  = 100 * time.Millisecond
	// retainEvery is how often retention runs.
	retainEvery = time.Minute
)

type recorder struct {
	db    *store.Records
	lim   RecordLimits
	ch    chan network.Record
	flush chan chan struct{}
	stop  chan struct{}
	done  sync.WaitGroup

	mu      sync.Mutex
	buckets map[string]*bucket
	dropped map[string]int64 // not yet written
}

// bucket is one sandbox's token bucket.
type bucket struct {
	tokens float64
	last   time.Time
}

// StartRecords makes the manager keep network records in db within lim,
// until StopRecords. Records that come before are not kept.
func (m *Manager) StartRecords(db *store.Records, lim RecordLimits) {
	rec := &recorder{db: db, lim: lim.withDefaults(), ch: make(chan network.Record, recordQueue),
		flush: make(chan chan struct{}), stop: make(chan struct{}),
		buckets: map[string]*bucket{}, dropped: map[string]int64{}}
	rec.done.Add(2)
	go m.writeRecords(rec)
	go m.retainRecords(rec)
	m.rec.Store(rec)
}

// StopRecords writes what is queued and stops the recorder's goroutines.
func (m *Manager) StopRecords() {
	rec := m.rec.Swap(nil)
	if rec == nil {
		return
	}
	close(rec.stop)
	rec.done.Wait()
}

// NetRecord takes a network record for the records database, unless its
// sandbox is over its rate or the queue is full (the drop is counted).
func (m *Manager) NetRecord(r network.Record) {
	rec := m.rec.Load()
	if rec == nil || r.Sandbox == "" {
		return
	}
	m.cfg.Metrics.NetDecision(r.Kind, r.Decision) // every decision, kept or not
	now := time.Now()
	rec.mu.Lock()
	b := rec.buckets[r.Sandbox]
	if b == nil {
		b = &bucket{tokens: float64(rec.lim.Burst), last: now}
		rec.buckets[r.Sandbox] = b
	}
	b.tokens = min(float64(rec.lim.Burst), b.tokens+now.Sub(b.last).Seconds()*rec.lim.Rate)
	b.last = now
	ok := b.tokens >= 1
	if ok {
		b.tokens--
	} else {
		rec.dropped[r.Sandbox]++
	}
	rec.mu.Unlock()
	if !ok {
		return
	}
	m.netEvent(r)
	select {
	case rec.ch <- r:
	default:
		rec.mu.Lock()
		rec.dropped[r.Sandbox]++
		rec.mu.Unlock()
	}
}

// writeRecords is the one writer: it batches the queue and writes it.
func (m *Manager) writeRecords(rec *recorder) {
	defer rec.done.Done()
	tick := time.NewTicker(recordTick)
	defer tick.Stop()
	kept := map[string]int64{} // per sandbox, as the database counts them
	var batch []network.Record
	write := func() {
		if err := rec.write(batch, kept); err != nil {
			m.log.Warn("network records", "err", err)
		}
		batch = batch[:0]
	}
	drain := func() {
		for {
			select {
			case r := <-rec.ch:
				batch = append(batch, r)
			default:
				return
			}
		}
	}
	for ticks := 0; ; {
		select {
		case r := <-rec.ch:
			batch = append(batch, r)
			if len(batch) >= recordBatch {
				write()
			}
		case <-tick.C:
			write()
			if ticks++; ticks%600 == 0 { // a minute: forget idle sandboxes
				clear(kept)
				rec.forgetIdle(time.Now())
			}
		case done := <-rec.flush:
			drain()
			write()
			close(done)
		case <-rec.stop:
			drain()
			write()
			return
		}
	}
}

// write applies the per-sandbox cap to a batch (kept: the sandboxes' counts
// so far, read from the database when missing) and writes it with the drop
// counts gathered since the last write.
func (rec *recorder) write(batch []network.Record, kept map[string]int64) error {
	rec.mu.Lock()
	drops := rec.dropped
	rec.dropped = map[string]int64{}
	rec.mu.Unlock()
	rows := make([]store.NetRecord, 0, len(batch))
	for _, r := range batch {
		n, ok := kept[r.Sandbox]
		if !ok {
			n, _, _ = rec.db.Counts(r.Sandbox)
		}
		if n >= rec.lim.PerSandbox {
			drops[r.Sandbox]++
			kept[r.Sandbox] = n
			continue
		}
		kept[r.Sandbox] = n + 1
		rows = append(rows, store.NetRecord{SandboxID: r.Sandbox, Time: r.Time, Kind: r.Kind, Decision: r.Decision,
			Proto: r.Proto, Dest: r.Dest, Name: r.Name, QType: r.QType, Detail: r.Detail})
	}
	return rec.db.Add(rows, drops)
}

// forgetIdle drops the buckets of sandboxes quiet long enough for their
// bucket to be full again.
func (rec *recorder) forgetIdle(now time.Time) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	full := time.Duration(float64(rec.lim.Burst)/rec.lim.Rate*float64(time.Second)) + time.Second
	for id, b := range rec.buckets {
		if now.Sub(b.last) > full {
			delete(rec.buckets, id)
		}
	}
}

// retainRecords deletes old records and audit events, and the oldest
// records beyond the size limit, now and then.
func (m *Manager) retainRecords(rec *recorder) {
	defer rec.done.Done()
	t := time.NewTicker(retainEvery)
	defer t.Stop()
	for {
		if n, err := rec.db.Retain(rec.lim.MaxAge, rec.lim.MaxBytes); err != nil {
			m.log.Warn("network records: retention", "err", err)
		} else if n > 0 {
			m.log.Info("network records: retention", "deleted", n)
		}
		if _, err := m.cfg.Store.PruneEvents(time.Now().Add(-rec.lim.MaxAge)); err != nil {
			m.log.Warn("audit events: retention", "err", err)
		}
		select {
		case <-rec.stop:
			return
		case <-t.C:
		}
	}
}

// FlushRecords writes the queued network records now, for a reader that
// wants what happened up to this moment (waiting at most a second).
func (m *Manager) FlushRecords() {
	rec := m.rec.Load()
	if rec == nil {
		return
	}
	done := make(chan struct{})
	select {
	case rec.flush <- done:
	case <-rec.stop:
		return
	case <-time.After(time.Second):
		return
	}
	select {
	case <-done:
	case <-time.After(time.Second):
	}
}

// RecordsPage is one page of a sandbox's network records, newest first.
type RecordsPage struct {
	Records []network.Record
	// Next is the cursor of the next page ("" on the last).
	Next string
	// Dropped counts the sandbox's records not kept: over its rate, over
	// its cap, or when the queue was full.
	Dropped int64
}

// MaxRecordsPage is the most records one page holds.
const MaxRecordsPage = 1000

// NetRecords returns a page of a running sandbox's network records: at
// most limit (1 to MaxRecordsPage), older than the cursor from the page
// before ("" for the first).
func (m *Manager) NetRecords(keyID, id string, limit int, cursor string) (RecordsPage, error) {
	var page RecordsPage
	if limit < 1 || limit > MaxRecordsPage {
		return page, fmt.Errorf("%w: limit must be 1 to %d records", ErrInvalid, MaxRecordsPage)
	}
	var before int64
	if cursor != "" {
		n, err := strconv.ParseInt(cursor, 10, 64)
		if err != nil || n <= 0 {
			return page, fmt.Errorf("%w: nextToken %q is not one this server gave", ErrInvalid, cursor)
		}
		before = n
	}
	if _, err := m.Get(keyID, id); err != nil {
		return page, err
	}
	rec := m.rec.Load()
	page.Records = []network.Record{}
	if rec == nil {
		return page, nil
	}
	m.FlushRecords()
	rows, err := rec.db.Page(id, before, limit+1)
	if err != nil {
		return page, err
	}
	if len(rows) > limit {
		rows = rows[:limit]
		page.Next = strconv.FormatInt(rows[limit-1].ID, 10)
	}
	for _, r := range rows {
		page.Records = append(page.Records, network.Record{Time: r.Time, Sandbox: r.SandboxID, Kind: r.Kind, Decision: r.Decision,
			Proto: r.Proto, Dest: r.Dest, Name: r.Name, QType: r.QType, Detail: r.Detail})
	}
	if _, page.Dropped, err = rec.db.Counts(id); err != nil {
		return page, err
	}
	return page, nil
}
