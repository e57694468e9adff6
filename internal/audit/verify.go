package audit

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
)

// Break is a place where the chain does not hold.
type Break struct {
	Seq    int64  // the entry where it breaks
	Reason string // what is wrong there
}

func (b Break) String() string { return fmt.Sprintf("entry %d: %s", b.Seq, b.Reason) }

// Checkpoint is a head exported earlier (Head): entry Seq had hash Hash.
type Checkpoint struct {
	Seq  int64
	Hash string
}

var hexHash = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[0-9a-f]{64}$`) })

// ParseCheckpoint reads "SEQ:HASH".
func ParseCheckpoint(s string) (Checkpoint, error) {
	seq, h, ok := strings.Cut(strings.TrimSpace(s), ":")
	n, err := strconv.ParseInt(seq, 10, 64)
	if !ok || err != nil || n < 1 || !hexHash().MatchString(h) {
		return Checkpoint{}, fmt.Errorf("checkpoint %q: want SEQ:HASH (a head printed by `cage audit verify`)", s)
	}
	return Checkpoint{Seq: n, Hash: h}, nil
}

func (c Checkpoint) String() string { return fmt.Sprintf("%d:%s", c.Seq, c.Hash) }

// Report is what Verify found.
type Report struct {
	Entries     int64 // entries read
	First, Last int64 // their seqs (0 when none)
	Head        string
	// Pruned is how many entries before First retention removed, as its
	// anchors say (0 when none).
	Pruned int64
	// Breaks are the places the chain does not hold, in order (at most
	// maxBreaks).
	Breaks []Break
	// Checkpoints: what each checkpoint given was found to be.
	Checkpoints []string
}

// OK says whether the chain held everywhere.
func (r *Report) OK() bool { return len(r.Breaks) == 0 }

const maxBreaks = 100

// anchorDetail is what an anchor entry says of the entries it removed.
type anchorDetail struct {
	Through int64  `json:"pruned_through"`
	Hash    string `json:"pruned_hash"`
}

// Verify walks the whole chain: each entry must be numbered one after the
// one before, carry that one's hash as its prev, and hash to its own hash;
// the first entry must be entry 1 (prev Genesis) or follow the entries an
// anchor says retention removed. checks are heads exported earlier: each
// must still be in the chain with the same hash (or be named by an anchor
// as removed with it).
func (db *DB) Verify(checks ...Checkpoint) (*Report, error) {
	rep := &Report{}
	anchors := map[int64]string{} // pruned_through -> pruned_hash
	found := map[int64]string{}
	want := map[int64]bool{}
	for _, c := range checks {
		want[c.Seq] = true
	}
	var prevSeq int64
	var prevHash, firstPrev string
	breakAt := func(seq int64, format string, args ...any) {
		if len(rep.Breaks) < maxBreaks {
			rep.Breaks = append(rep.Breaks, Break{Seq: seq, Reason: fmt.Sprintf(format, args...)})
		}
	}
	err := db.each(0, func(e Entry) bool {
		rep.Entries++
		if rep.Entries == 1 {
			rep.First, firstPrev = e.Seq, e.Prev
			if e.Seq == 1 && e.Prev != Genesis {
				breakAt(1, "the first entry does not start a chain (its prev is not the genesis hash)")
			}
		} else {
			switch {
			case e.Seq == prevSeq+2:
				breakAt(prevSeq+1, "missing: not in the trail (deleted)")
			case e.Seq != prevSeq+1:
				breakAt(prevSeq+1, "missing: entries %d to %d are not in the trail (deleted)", prevSeq+1, e.Seq-1)
			case e.Prev != prevHash:
				breakAt(e.Seq, "does not follow entry %d: its prev is not that entry's hash (this entry was replaced or moved here, or entry %d was rewritten)", prevSeq, prevSeq)
			}
		}
		if got := e.ComputeHash(); got != e.Hash {
			breakAt(e.Seq, "changed: its fields do not hash to its stored hash (kind %q, time %s)", e.Kind, e.Time.Format("2006-01-02T15:04:05.000Z07:00"))
		}
		if e.Kind == KindAnchor {
			var a anchorDetail
			if json.Unmarshal([]byte(e.Detail), &a) == nil && a.Through > 0 {
				anchors[a.Through] = a.Hash
				rep.Pruned = max(rep.Pruned, a.Through)
			}
		}
		if want[e.Seq] {
			found[e.Seq] = e.Hash
		}
		prevSeq, prevHash = e.Seq, e.Hash
		return true
	})
	if err != nil {
		return nil, err
	}
	rep.Last, rep.Head = prevSeq, prevHash
	if rep.Entries == 0 {
		rep.Head = Genesis
	}
	if rep.First > 1 {
		if h, ok := anchors[rep.First-1]; !ok {
			breakAt(rep.First, "entries 1 to %d are not in the trail and no anchor says retention removed them", rep.First-1)
		} else if h != firstPrev {
			breakAt(rep.First, "does not follow the entries retention removed: its prev is not the hash the anchor gives entry %d", rep.First-1)
		}
	}
	for _, c := range checks {
		rep.Checkpoints = append(rep.Checkpoints, checkpoint(c, found, anchors, rep, breakAt))
	}
	return rep, nil
}

// checkpoint checks one exported head against what the walk found.
func checkpoint(c Checkpoint, found, anchors map[int64]string, rep *Report, breakAt func(int64, string, ...any)) string {
	h, inChain := found[c.Seq]
	switch {
	case inChain && h == c.Hash:
		return fmt.Sprintf("checkpoint %s: in the chain", c)
	case inChain:
		breakAt(c.Seq, "differs from the checkpoint exported earlier (%s): the chain was rewritten from here or before", c)
		return fmt.Sprintf("checkpoint %s: REWRITTEN (entry %d now hashes to %s)", c, c.Seq, h)
	case c.Seq > rep.Last:
		breakAt(rep.Last+1, "missing: the checkpoint exported earlier names entry %d, past the chain's end (%d): entries were removed from the end", c.Seq, rep.Last)
		return fmt.Sprintf("checkpoint %s: MISSING (the chain ends at %d)", c, rep.Last)
	}
	if ah, ok := anchors[c.Seq]; ok && ah == c.Hash {
		return fmt.Sprintf("checkpoint %s: removed by retention, as an anchor says", c)
	}
	if c.Seq < rep.First {
		return fmt.Sprintf("checkpoint %s: removed by retention (before entry %d); no anchor names it", c, rep.First)
	}
	return fmt.Sprintf("checkpoint %s: not found", c)
}
