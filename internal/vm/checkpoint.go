package vm

import (
	"context"
	"errors"
	"fmt"
	"os"
)

// Checkpoints. A checkpoint is a whole VM saved to one file: QEMU's
// migration of the stopped VM, its RAM included (every page the guest
// holds, zero pages as a flag), into a descriptor. Resume starts a new
// QEMU with the same machine and devices, waiting for a migration, feeds it
// the file and lets the guest go on. Unlike a snapshot's, a checkpoint's
// RAM is in the file: the VM's RAM may be a private copy (a VM restored
// from a snapshot) or anonymous, and the new VM's is anonymous (NamedRAM
// where the old one's RAM was a file).
//
// The host hands the file to QEMU and never reads it: it is the guest's
// memory, and only a QEMU of the same machine loads it.

// checkpointCaps: all of the RAM is sent, and the end of the migration is
// an event.
var checkpointCaps = map[string]any{"capabilities": []map[string]any{
	{"capability": "x-ignore-shared", "state": false},
	{"capability": "events", "state": true},
}}

// checkpointBandwidth lifts QEMU's default cap on a migration's rate
// (128 MiB/s in 7.2), which is for a live migration over a network, not for
// a stopped VM written to a local file.
var checkpointBandwidth = map[string]any{"max-bandwidth": int64(1) << 40}

// Checkpoint stops the VM and writes all of it to f. On success the VM
// stays stopped (Stop it); on error it is running again (Cont was sent)
// unless QEMU is gone.
func (v *VM) Checkpoint(ctx context.Context, f *os.File) error {
	q, err := v.qmp(ctx)
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	defer q.Close()
	if err := q.pipeline(ctx,
		qmpCommand{name: "migrate-set-capabilities", args: checkpointCaps},
		qmpCommand{name: "migrate-set-parameters", args: checkpointBandwidth},
		qmpCommand{name: "stop"},
		qmpCommand{name: "getfd", args: map[string]any{"fdname": stateFD}, file: f},
		qmpCommand{name: "migrate", args: map[string]any{"uri": "fd:" + stateFD}},
	); err != nil {
		err = v.qemuGone(ctx, err)
		_, _ = q.call(context.Background(), "cont", nil)
		return fmt.Errorf("checkpoint: %w", err)
	}
	if err := q.waitMigration(ctx); err != nil {
		err = v.qemuGone(ctx, err)
		_, _ = q.call(context.Background(), "migrate_cancel", nil)
		_, _ = q.call(context.Background(), "cont", nil)
		if v.atFileBound(f) {
			err = fmt.Errorf("%w: QEMU wrote %d MiB of state, the most a VM of %d MiB may", ErrFileBound, v.cfg.fileBytes()>>20, v.cfg.memoryMB())
		}
		return fmt.Errorf("checkpoint: %w", err)
	}
	return nil
}

// ErrFileBound: QEMU wrote a file up to its bound (Config.FileBytes),
// which an honest QEMU never reaches.
var ErrFileBound = errors.New("file size bound reached")

// atFileBound reports whether f, written by a jailed QEMU, reached the
// bound of its files.
func (v *VM) atFileBound(f *os.File) bool {
	if v.cfg.Credential == nil {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Size() >= v.cfg.fileBytes()
}

// Cont lets a stopped VM run again (after a checkpoint that is not used).
func (v *VM) Cont(ctx context.Context) error {
	q, err := v.qmp(ctx)
	if err != nil {
		return err
	}
	defer q.Close()
	if _, err := q.call(ctx, "cont", nil); err != nil {
		return v.qemuGone(ctx, err)
	}
	return v.checkRunning(ctx, q)
}

// Resume starts a VM from a checkpoint: cfg must describe the machine that
// Checkpoint saved (kernel, initramfs, memory, CPUs, disks in the same
// order, a NIC if it had one, NamedRAM if its RAM was a file), with no
// MemoryFile or MemoryFD. Resume returns once the guest runs again.
func Resume(ctx context.Context, cfg Config, f *os.File) (*VM, error) {
	if cfg.MemoryFile != "" || cfg.MemoryFD != nil {
		return nil, errors.New("resume vm: a checkpoint carries its own memory")
	}
	cfg.incoming = true
	v, err := launch(cfg)
	if err != nil {
		return nil, fmt.Errorf("resume vm: %w", err)
	}
	if cfg.Jail != nil {
		if err := cfg.Jail(v.Pid()); err != nil {
			v.Stop()
			return nil, fmt.Errorf("resume vm: %w", err)
		}
	}
	if err := v.incomingFrom(ctx, f, checkpointCaps); err != nil {
		v.Stop()
		return nil, fmt.Errorf("resume vm: %w", err)
	}
	return v, nil
}
