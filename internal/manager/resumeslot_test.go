package manager

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/store"
)

// TestResumeTakesACreateSlot: a resume from saved files starts a sandbox
// as a create does, and waits for one of the same slots: with every slot
// taken it gives up when its caller does (before, resumes took none, and a
// tenant could resume all its paused sandboxes at once past the host's
// bound on starts).
func TestResumeTakesACreateSlot(t *testing.T) {
	data := t.TempDir()
	m := New(Config{Data: data, MaxCreating: 1})
	rec := &store.Sandbox{ID: "0123456789abcdef0123", State: store.StatePaused, PauseKind: PauseFiles}
	if err := os.MkdirAll(filepath.Join(data, "paused"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(m.savedFiles(rec.ID), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	release, err := m.createSlot(context.Background(), rec.KeyID)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := m.resumeFiles(ctx, rec, time.Minute); !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, ErrLimit) {
		t.Errorf("a resume with every create slot taken: %v, want it to wait for one", err)
	}
}
