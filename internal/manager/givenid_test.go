package manager

import (
	"errors"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/store"
)

// TestGivenID: a create's given id (cluster mode: the pod's name) must have
// ids.NewID's format and name no sandbox of this host, checked before
// anything is made.
func TestGivenID(t *testing.T) {
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	const taken = "0123456789abcdef0123"
	if err := st.InsertSandbox(&store.Sandbox{ID: taken, State: store.StateRunning, NetSlot: -1,
		StartedAt: time.Now(), EndAt: time.Now().Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	m := &Manager{cfg: Config{Store: st}}
	for id, want := range map[string]error{
		"": nil, "aaaaaaaaaabbbbbbbbbb": nil,
		taken: ErrConflict, "abc": ErrInvalid, "0123456789ABCDEF0123": ErrInvalid,
		"0123456789abcdef012g": ErrInvalid, "../../../etc/passwd0": ErrInvalid,
	} {
		if err := m.checkID(id); !errors.Is(err, want) || (want == nil) != (err == nil) {
			t.Errorf("checkID(%q) = %v, want %v", id, err, want)
		}
	}
}
