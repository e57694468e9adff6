package vm

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/cagehq/cage/internal/trace"
)

// Snapshots. A VM to snapshot runs with its RAM in a file mapped shared
// (Config.MemoryFile, ShareMemory), so that the file is its RAM. Snapshot
// stops it and has QEMU migrate into a state file with x-ignore-shared on:
// the device and CPU state only (tens of KB), RAM in shared memory being
// left where it is. Restore starts a QEMU with the same machine and devices
// and the same memory file mapped private, feeds it the state file and lets
// the guest go on where the snapshot stopped it. The migration travels
// through a descriptor handed over QMP (getfd, "fd:" URIs): QEMU 7.2 has no
// "file:" URI, and "exec:" would need a shell, which QEMU's seccomp sandbox
// forbids it to spawn.

// migrationCaps are the capabilities both ends of a snapshot need: RAM in
// shared memory is not sent, and the end of the migration is an event
// rather than something to poll for.
var migrationCaps = map[string]any{"capabilities": []map[string]any{
	{"capability": "x-ignore-shared", "state": true},
	{"capability": "events", "state": true},
}}

const stateFD = "state"

// Snapshot stops the VM and writes its state, all but its RAM, to
// stateFile; the VM must have been started with a shared MemoryFile, which
// then holds the RAM. The VM stays stopped: Stop it after.
func (v *VM) Snapshot(ctx context.Context, stateFile string) error {
	if v.cfg.MemoryFile == "" || !v.cfg.ShareMemory {
		return errors.New("snapshot: the vm's memory is not a shared file")
	}
	f, err := os.OpenFile(stateFile, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	defer f.Close()
	q, err := v.qmp(ctx)
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	defer q.Close()
	// Stopped first, so that the guest writes nothing to the RAM file
	// after the device state is taken.
	if err := q.pipeline(ctx,
		qmpCommand{name: "migrate-set-capabilities", args: migrationCaps},
		qmpCommand{name: "stop"},
		qmpCommand{name: "getfd", args: map[string]any{"fdname": stateFD}, file: f},
		qmpCommand{name: "migrate", args: map[string]any{"uri": "fd:" + stateFD}},
	); err != nil {
		return fmt.Errorf("snapshot: %w", v.qemuGone(ctx, err))
	}
	if err := q.waitMigration(ctx); err != nil {
		return fmt.Errorf("snapshot: %w", v.qemuGone(ctx, err))
	}
	return nil
}

// Restore starts a VM from a snapshot: cfg must describe the machine that
// Snapshot saved (the same kernel, initramfs, memory, CPUs and disks, in
// the same order) with MemoryFile its RAM file; Dir is the new VM's own.
// The file is mapped private whatever ShareMemory says, so that the
// snapshot stays as it is. Restore returns once the guest runs again.
func Restore(ctx context.Context, cfg Config, stateFile string) (*VM, error) {
	if cfg.MemoryFile == "" && cfg.MemoryFD == nil {
		return nil, errors.New("restore vm: no memory file")
	}
	if cfg.MemoryFD == nil && !fileExists(cfg.MemoryFile) {
		return nil, fmt.Errorf("restore vm: no memory file at %q", cfg.MemoryFile)
	}
	cfg.ShareMemory = false
	cfg.incoming = true
	f, err := os.Open(stateFile)
	if err != nil {
		return nil, fmt.Errorf("restore vm: %w", err)
	}
	defer f.Close()
	v, err := launch(cfg)
	if err != nil {
		return nil, fmt.Errorf("restore vm: %w", err)
	}
	trace.Mark("vm: qemu started")
	if cfg.Jail != nil {
		if err := cfg.Jail(v.Pid()); err != nil {
			v.Stop()
			return nil, fmt.Errorf("restore vm: %w", err)
		}
		trace.Mark("vm: in its cgroup")
	}
	if err := v.incomingFrom(ctx, f, migrationCaps); err != nil {
		v.Stop()
		return nil, fmt.Errorf("restore vm: %w", err)
	}
	return v, nil
}

// incomingFrom feeds a VM waiting for a migration (-incoming defer) the
// state in state, with the capabilities caps, and lets it run.
func (v *VM) incomingFrom(ctx context.Context, state *os.File, caps map[string]any) error {
	q, err := v.qmp(ctx)
	if err != nil {
		return err
	}
	defer q.Close()
	// All at once: QEMU waits (-incoming defer) and each reply would only
	// cost a round trip.
	if err := q.pipeline(ctx,
		qmpCommand{name: "migrate-set-capabilities", args: caps},
		qmpCommand{name: "getfd", args: map[string]any{"fdname": stateFD}, file: state},
		qmpCommand{name: "migrate-incoming", args: map[string]any{"uri": "fd:" + stateFD}},
	); err != nil {
		return v.qemuGone(ctx, err)
	}
	trace.Mark("vm: qmp answered")
	if err := q.waitMigration(ctx); err != nil {
		return v.qemuGone(ctx, err)
	}
	trace.Mark("vm: state loaded")
	// The snapshot's VM was stopped, so the restored one stays paused
	// after the migration (it takes the source's run state) until told.
	if _, err := q.call(ctx, "cont", nil); err != nil {
		return v.qemuGone(ctx, err)
	}
	return v.checkRunning(ctx, q)
}
