package abuse

import (
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// TestVolumeCallsNotHeldByOthersCreates: tenant A's create that mounts a
// volume and takes long to start (here: from a snapshot of some hundreds
// of MiB, which the new sandbox's agent unpacks before the create is
// answered) must not hold tenant B's volume calls. Found by review,
// 2026-12-03: a create held the daemon's one volume lock (read side) for
// its whole start, and every volume create and delete (write side) of
// every tenant waited for it, and every other create with a volume behind
// them.
func TestVolumeCallsNotHeldByOthersCreates(t *testing.T) {
	d := cageserve.Start(t)
	keyA, keyB := d.Key, d.NewKey(t, "tenant-b")
	newVolume(t, d, keyA, "a-vol")

	// A's snapshot: enough bytes that unpacking them takes a while.
	sb := d.Create(t, keyA, map[string]any{"timeout": 600, "diskSizeMB": 1024})
	if _, err := runSh(d.Agent(sb.SandboxID, sb.EnvdAccessToken), "head -c 400M /dev/urandom > $HOME/bulk"); err != nil {
		t.Fatalf("write the bulk: %v", err)
	}
	status, out, _ := d.Do("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", keyA, map[string]any{"name": "bulk"})
	var snap types.SnapshotInfo
	if status != http.StatusCreated || json.Unmarshal(out, &snap) != nil {
		t.Fatalf("snapshot: %d %s", status, out)
	}
	d.Kill(keyA, sb.SandboxID)

	before := map[string]bool{}
	for _, id := range sandboxDirs(d) {
		before[id] = true
	}
	type result struct {
		status int
		msg    string
		at     time.Time
	}
	aDone := make(chan result, 1)
	start := time.Now()
	go func() {
		_, st, msg := d.TryCreate(keyA, map[string]any{"templateID": snap.SnapshotID, "timeout": 600,
			"volumeMounts": []map[string]any{{"name": "a-vol", "path": "/mnt/a"}}})
		aDone <- result{st, msg, time.Now()}
	}()
	// Once A's sandbox is on the host, its create is in its start.
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
		started := false
		for _, id := range sandboxDirs(d) {
			started = started || !before[id]
		}
		if started {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("A's create never started")
		}
	}
	bStart := time.Now()
	status, out, _ = d.Do("POST", "/volumes", keyB, map[string]any{"name": "b-vol"})
	bAt := time.Now()
	if status != http.StatusCreated {
		t.Fatalf("B's volume: %d %s", status, out)
	}
	var a result
	select {
	case a = <-aDone:
	case <-time.After(3 * time.Minute):
		t.Fatal("A's create did not end")
	}
	if a.status != http.StatusCreated {
		t.Fatalf("A's create: %d %s", a.status, a.msg)
	}
	t.Logf("A's create took %v; B's volume create took %v (started %v into A's)", a.at.Sub(start), bAt.Sub(bStart), bStart.Sub(start))
	if !bAt.Before(a.at) {
		t.Errorf("B's volume create waited for A's create with a volume (answered %v after it)", bAt.Sub(a.at))
	}
}
