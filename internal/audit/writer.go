package audit

import (
	"strings"
	"time"
)

// writerState is the writer goroutine's own: no lock.
type writerState struct {
	kept    map[string]int64     // per sandbox, as the counts table has them (loaded when first seen)
	capped  map[string]bool      // sandboxes whose audit.capped entry is written
	pending map[string]int64     // not kept since the last report: per sandbox, "key:ID", "team:ID" or "anon"
	owners  map[string]string    // sandbox -> its key
	seen    map[string]time.Time // sandbox -> when last seen, to forget the idle
	batch   []Event
}

func newWriterState() writerState {
	return writerState{kept: map[string]int64{}, capped: map[string]bool{}, pending: map[string]int64{},
		owners: map[string]string{}, seen: map[string]time.Time{}}
}

// forgetAfter: a sandbox not seen for this long is forgotten by the writer
// (its counts are read again from the database if it comes back).
const forgetAfter = 10 * time.Minute

// writer is the one goroutine that writes: it batches the queue.
func (t *Trail) writer() {
	defer t.done.Done()
	tk := time.NewTicker(tick)
	defer tk.Stop()
	w := &t.w
	drain := func() {
		for {
			select {
			case ev := <-t.ch:
				w.batch = append(w.batch, ev)
			default:
				return
			}
		}
	}
	ticks := 0
	for {
		select {
		case ev := <-t.ch:
			w.batch = append(w.batch, ev)
			if len(w.batch) >= batchSize {
				t.writeBatch(false)
			}
		case <-tk.C:
			ticks++
			t.writeBatch(ticks%int(time.Minute/tick) == 0)
		case done := <-t.flush:
			drain()
			t.writeBatch(false)
			close(done)
		case <-t.stop:
			drain()
			t.writeBatch(true)
			return
		}
	}
}

// writeBatch writes the batch; report also writes the counts of entries
// not kept since the last report, and forgets idle sandboxes.
func (t *Trail) writeBatch(report bool) {
	w := &t.w
	now := time.Now()
	counts := map[string]*tally{}
	tallyOf := func(sb, key string) *tally {
		c := counts[sb]
		if c == nil {
			c = &tally{}
			counts[sb] = c
		}
		if key != "" {
			c.key = key
		}
		return c
	}
	rows := make([]row, 0, len(w.batch))
	for _, ev := range w.batch {
		rows = t.admit(ev, rows, tallyOf, now)
	}
	w.batch = w.batch[:0]
	t.mu.Lock()
	lost := t.lost
	t.lost = map[string]int64{}
	t.mu.Unlock()
	for k, n := range lost {
		w.pending[k] += n
		if !strings.HasPrefix(k, "key:") && !strings.HasPrefix(k, "team:") && k != "anon" {
			tallyOf(k, w.owners[k]).dropped += n
		}
	}
	if report {
		rows = t.report(rows, now)
	}
	if err := t.db.write(rows, counts); err != nil {
		t.log.Warn("audit: write", "err", err, "entries", len(rows))
	}
}

// admit applies the owner and the per-sandbox cap to one event and adds
// what is to be written to rows.
func (t *Trail) admit(ev Event, rows []row, tallyOf func(sb, key string) *tally, now time.Time) []row {
	w := &t.w
	sb := ev.SandboxID
	if sb == "" || !ownedBySandbox(ev.Kind) {
		return append(rows, newRow(ev, now))
	}
	w.seen[sb] = now
	if ev.KeyID != "" {
		w.owners[sb] = ev.KeyID
	} else {
		ev.KeyID = t.ownerOf(sb)
	}
	if capped(ev.Kind) {
		n, ok := w.kept[sb]
		if !ok {
			_, n, _, _ = t.db.Counts(sb)
		}
		if n >= t.lim.PerSandbox {
			w.kept[sb] = n
			w.pending[sb]++
			tallyOf(sb, ev.KeyID).dropped++
			if !w.capped[sb] {
				w.capped[sb] = true
				rows = append(rows, newRow(Event{Kind: KindCapped, KeyID: ev.KeyID, SandboxID: sb, Detail: map[string]any{
					"cap": t.lim.PerSandbox, "first_not_kept": ev.Kind,
					"note": "entries of processes, files, envd calls and network decisions of this sandbox beyond the cap are counted, not kept"}}, now))
			}
			return rows
		}
		w.kept[sb] = n + 1
		tallyOf(sb, ev.KeyID).kept++
	}
	rows = append(rows, newRow(ev, now))
	if ends(ev.Kind) && w.pending[sb] > 0 {
		rows = append(rows, t.droppedRow(sb, ev.KeyID, w.pending[sb], now))
		delete(w.pending, sb)
	}
	return rows
}

// ownerOf is the key a sandbox belongs to, "" when unknown.
func (t *Trail) ownerOf(sb string) string {
	if k, ok := t.w.owners[sb]; ok {
		return k
	}
	owner := t.owner.Load()
	if owner == nil {
		return ""
	}
	k := (*owner)(sb)
	if k != "" {
		t.w.owners[sb] = k
	}
	return k
}

func (t *Trail) droppedRow(sb, key string, n int64, now time.Time) row {
	return newRow(Event{Kind: KindDropped, KeyID: key, SandboxID: sb, Detail: map[string]any{"not_kept": n, "cap": t.lim.PerSandbox}}, now)
}

// report adds an audit.dropped entry for each sandbox, key and the
// anonymous callers with entries not kept since the last report, and
// forgets idle sandboxes.
func (t *Trail) report(rows []row, now time.Time) []row {
	w := &t.w
	for k, n := range w.pending {
		switch {
		case k == "anon":
			rows = append(rows, newRow(Event{Kind: KindDropped, Detail: map[string]any{"not_kept": n,
				"why": "requests without a valid credential over their rate, or the queue full"}}, now))
		case strings.HasPrefix(k, "key:"):
			rows = append(rows, newRow(Event{Kind: KindDropped, KeyID: strings.TrimPrefix(k, "key:"), Detail: map[string]any{
				"not_kept": n, "why": "API calls over the key's rate, or the queue full"}}, now))
		case strings.HasPrefix(k, "team:"):
			rows = append(rows, newRow(Event{Kind: KindDropped, TeamID: strings.TrimPrefix(k, "team:"), Detail: map[string]any{
				"not_kept": n, "why": "calls on the team's volumes over their rate, or the queue full"}}, now))
		default:
			rows = append(rows, t.droppedRow(k, w.owners[k], n, now))
		}
	}
	clear(w.pending)
	for sb, at := range w.seen {
		if now.Sub(at) > forgetAfter {
			delete(w.seen, sb)
			delete(w.kept, sb)
			delete(w.capped, sb)
			delete(w.owners, sb)
		}
	}
	t.mu.Lock()
	full := time.Duration(float64(t.lim.KeyBurst)/t.lim.KeyRate*float64(time.Second)) + time.Second
	for k, b := range t.buckets {
		if now.Sub(b.last) > full {
			delete(t.buckets, k)
		}
	}
	t.mu.Unlock()
	return rows
}
