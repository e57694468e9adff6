package manager

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/store"
)

// TestTransitionsForgotten: kills, pauses, resumes and snapshots of ids no
// sandbox has (malformed and 16 KiB long, well formed but unknown, and
// another tenant's) are not found, and leave no lock behind; nor does a
// lock a caller took once it is let go, waiters and all. (Before, every id
// ever named kept a lock for good: 20,000 refused kills of 16 KiB ids took
// a daemon from 30 MB to 705 MB.)
func TestTransitionsForgotten(t *testing.T) {
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	const theirs = "0123456789abcdef0123"
	if err := st.InsertSandbox(&store.Sandbox{ID: theirs, KeyID: "other", State: store.StateRunning, NetSlot: -1,
		StartedAt: time.Now(), EndAt: time.Now().Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	m := New(Config{Store: st, MaxCreating: 1})
	long := strings.Repeat("a", 16<<10)
	for _, id := range []string{long, "aaaaaaaaaabbbbbbbbbb", theirs, "../x"} {
		for name, call := range map[string]func() error{
			"kill":  func() error { return m.Kill("mine", id) },
			"pause": func() error { return m.Pause(context.Background(), "mine", id, false) },
			"resume": func() error {
				_, _, err := m.Resume(context.Background(), "mine", id, time.Minute, false)
				return err
			},
			"snapshot": func() error { _, err := m.Snapshot(context.Background(), "mine", id, ""); return err },
		} {
			if err := call(); !errors.Is(err, ErrNotFound) || len(err.Error()) > 200 {
				t.Errorf("%s of %.24q: %.200v, want not found (briefly)", name, id, err)
			}
		}
	}
	var wg sync.WaitGroup
	unlock := m.transition(theirs)
	for range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); m.transition(theirs)() }()
	}
	time.Sleep(20 * time.Millisecond)
	unlock()
	wg.Wait()
	m.transMu.Lock()
	n := len(m.transitions)
	m.transMu.Unlock()
	if n != 0 {
		t.Errorf("%d transition locks left after every caller let go", n)
	}
}
