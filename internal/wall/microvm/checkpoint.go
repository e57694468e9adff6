package microvm

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/vm"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/channel"
	"github.com/cagehq/cage/internal/wall/microvm/guest"
	"github.com/cagehq/cage/internal/wall/state"
)

// Checkpoints: the host leaves the guest (its agent, which serves on,
// waits for the next host), and QEMU saves the stopped VM whole, its RAM
// included, into checkpointState (vm.Checkpoint); QEMU then ends, and the
// sandbox gives up everything it had on the host (cgroup, network,
// namespace, directory) but its uid range, whose slot is its network
// address: nothing of it is in memory. A restore makes those again as a
// create does, in the same slot, resumes the VM from the file in a new
// QEMU (vm.Resume) and greets the agent, which has the guest's init set
// the clock and mix in fresh random bytes before it serves again
// (guest.Spec's resume). The guest's processes, files and RAM are the
// checkpoint's. So a microvm checkpoint outlives a restart of the daemon
// and of the host alike: it needs only the slot, the same QEMU, kernel,
// agent and template image (checkpointShape says which).
//
// The file is written by QEMU from the guest's memory; the host hands it
// to QEMU and never reads it.
const (
	checkpointState = "state"
	checkpointShape = "vm.json"
)

// checkpointMeta is what a checkpoint's VM was, for its restore.
type checkpointMeta struct {
	Shape    shape `json:"shape"`
	NamedRAM bool  `json:"named_ram"` // its RAM was a file (see vm.Config.NamedRAM)
}

// leaveGrace lets the guest see the host go before QEMU stops it, so that
// the agent is waiting for the next host when it is saved (not needed:
// see greetAgain).
const leaveGrace = 100 * time.Millisecond

// Checkpoint saves the running VM into dir and stops it. On error dir
// holds nothing of the checkpoint: a state QEMU wrote half of (the disk
// filled, or it reached the bound of QEMU's files, vm.FileBound) is
// removed.
func (sb *Sandbox) Checkpoint(ctx context.Context, dir string) error {
	sb.mu.Lock()
	if sb.stopping || sb.v == nil {
		sb.mu.Unlock()
		return fmt.Errorf("sandbox %s is not running", sb.id)
	}
	sb.mu.Unlock()
	f, err := sb.checkpointFiles(dir)
	if err != nil {
		return fmt.Errorf("checkpoint sandbox %s: %w", sb.id, err)
	}
	defer f.Close()
	sb.mu.Lock()
	sb.stopping = true
	sb.mu.Unlock()
	sb.sess.Close()
	time.Sleep(leaveGrace)
	err = sb.v.Checkpoint(ctx, f)
	if err == nil {
		if err = f.Sync(); err != nil {
			_ = sb.v.Cont(ctx)
		}
	}
	if err != nil {
		_ = os.Remove(filepath.Join(dir, checkpointState))
		_ = os.Remove(filepath.Join(dir, checkpointShape))
		// The VM runs again (vm.Checkpoint sent cont): a host again.
		if aerr := sb.attach(ctx); aerr != nil {
			sb.v.Stop()
			return fmt.Errorf("checkpoint sandbox %s: %w: %v; and it could not go on: %v", sb.id, wall.ErrStopped, err, aerr)
		}
		sb.mu.Lock()
		sb.stopping = false
		sb.mu.Unlock()
		return fmt.Errorf("checkpoint sandbox %s: %w", sb.id, err)
	}
	// Saved: nothing of the sandbox runs or stays on the host but its
	// uid range (its slot). Its network goes too, and its restore makes
	// it again under the policy it has now (changed since the create,
	// maybe), not the create's.
	if sb.net != nil {
		sb.cfg.NetPolicy = sb.net.Policy()
	}
	return sb.release()
}

// checkpointFiles writes the checkpoint's shape into dir and opens its
// state file.
func (sb *Sandbox) checkpointFiles(dir string) (*os.File, error) {
	sh, err := shapeOf(sb.vcfg)
	if err != nil {
		return nil, err
	}
	b, err := json.Marshal(checkpointMeta{Shape: sh, NamedRAM: sb.restored})
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, checkpointShape), b, 0o600); err != nil {
		return nil, err
	}
	return os.OpenFile(filepath.Join(dir, checkpointState), os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
}

// Restore starts the checkpointed sandbox again from dir; started is
// called once QEMU runs the guest again, before its agent is greeted.
func (sb *Sandbox) Restore(ctx context.Context, dir string, started func()) (err error) {
	sb.mu.Lock()
	stopped := sb.stopping && sb.owner == nil
	sb.mu.Unlock()
	if !stopped {
		return fmt.Errorf("sandbox %s is not checkpointed", sb.id)
	}
	b, err := os.ReadFile(filepath.Join(dir, checkpointShape))
	if err != nil {
		return fmt.Errorf("restore sandbox %s: %w", sb.id, err)
	}
	var meta checkpointMeta
	if err := json.Unmarshal(b, &meta); err != nil {
		return fmt.Errorf("restore sandbox %s: %s: %w", sb.id, checkpointShape, err)
	}
	f, err := os.Open(filepath.Join(dir, checkpointState))
	if err != nil {
		return fmt.Errorf("restore sandbox %s: %w", sb.id, err)
	}
	defer f.Close()
	defer func() {
		if err != nil {
			_ = sb.release()
			sb.mu.Lock()
			sb.sess = nil
			sb.mu.Unlock()
		}
	}()
	if err := sb.setUp(); err != nil {
		return fmt.Errorf("restore sandbox %s: %w", sb.id, err)
	}
	// The same machine (with its NIC, set up now), or nothing.
	now, err := shapeOf(sb.vcfg)
	if err != nil {
		return err
	}
	if nb, _ := json.Marshal(now); string(nb) != string(mustJSON(meta.Shape)) {
		return fmt.Errorf("restore sandbox %s: its checkpoint is of another VM (QEMU, kernel, agent or image changed since)", sb.id)
	}
	vcfg := sb.vcfg
	vcfg.NamedRAM = meta.NamedRAM
	v, err := vm.Resume(ctx, vcfg, f)
	if err != nil {
		return fmt.Errorf("restore sandbox %s: %w", sb.id, err)
	}
	sb.v = v
	if started != nil {
		started()
	}
	// The guest's agent answers when the guest lets it: a guest of the
	// sandbox's own making, up to ctx.
	if err := sb.attach(ctx); err != nil {
		return fmt.Errorf("restore sandbox %s: %w", sb.id, err)
	}
	sb.mu.Lock()
	sb.stopping = false
	sb.mu.Unlock()
	go sb.watchVM(v)
	return nil
}

func mustJSON(v any) []byte { b, _ := json.Marshal(v); return b }

// attach greets the guest's agent, which waits for a host after the last
// one left, and sends it a resume's spec.
func (sb *Sandbox) attach(ctx context.Context) error {
	sess, err := greetAgain(ctx, sb.v)
	if err != nil {
		return err
	}
	first, err := sess.Open()
	if err != nil {
		sess.Close()
		return err
	}
	defer first.Close()
	entropy := make([]byte, guest.EntropyBytes)
	if _, err := rand.Read(entropy); err != nil {
		sess.Close()
		return err
	}
	err = json.NewEncoder(first).Encode(guest.Spec{Resume: true, Entropy: entropy, UnixNano: time.Now().UnixNano()})
	if err == nil {
		err = readLine(ctx, first, bufio.NewReader(first), guest.Ready)
	}
	if err != nil {
		sess.Close()
		return fmt.Errorf("the guest's agent did not serve again: %w (%s)", err, consoleTail(sb.v))
	}
	sb.mu.Lock()
	sb.sess = sess
	sb.mu.Unlock()
	go nudge(sess, sb.reportStall)
	return nil
}

// helloWindow bounds what greetAgain skips before the guest's hello.
const helloWindow = 64 << 10

// greetAgain is greet for a guest that served a host before: what its
// agent wrote as the old host left may come first (a frame that was on
// its way as QEMU stopped), and is skipped up to the hello.
func greetAgain(ctx context.Context, v *vm.VM) (*yamux.Session, error) {
	conn, err := v.DialAgent(ctx)
	if err != nil {
		return nil, err
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetReadDeadline(dl)
	}
	// A guest that keeps silent is waited for until ctx ends, its
	// cancellation included.
	stop := context.AfterFunc(ctx, func() { _ = conn.SetReadDeadline(time.Now()) })
	br := bufio.NewReader(conn)
	for skipped := 0; ; {
		line, err := readLineMax(br, helloWindow+len(guest.Hello))
		if err != nil {
			stop()
			conn.Close()
			return nil, fmt.Errorf("the guest did not come back: %w (%s)", err, consoleTail(v))
		}
		if strings.HasSuffix(line, guest.Hello) {
			break
		}
		if skipped += len(line); skipped > helloWindow {
			stop()
			conn.Close()
			return nil, errors.New("the guest did not come back: no hello")
		}
	}
	if !stop() {
		conn.Close()
		return nil, fmt.Errorf("the guest did not come back: %w", context.Cause(ctx))
	}
	_ = conn.SetReadDeadline(time.Time{})
	sess, err := channel.Client(struct {
		io.Reader
		io.WriteCloser
	}{br, conn})
	if err != nil {
		conn.Close()
		return nil, err
	}
	return sess, nil
}

// CheckpointsMissing: QEMU checkpoints wherever the wall runs.
func (d *Driver) CheckpointsMissing() error { return d.Missing() }

// AdoptCheckpointed takes charge of a sandbox another process checkpointed
// into dir: its slot is taken again (-1: any range), and whatever a
// restore cut short by a crash left is removed.
func (d *Driver) AdoptCheckpointed(ctx context.Context, spec wall.Spec, slot int, dir string) (wall.Sandbox, error) {
	if err := d.Missing(); err != nil {
		return nil, err
	}
	networked := spec.Net != nil && spec.NetPolicy.Networked()
	if networked && slot < 0 {
		return nil, fmt.Errorf("sandbox %s: no network slot recorded", spec.ID)
	}
	k, _ := d.guestKernel()
	accel, _ := d.Accel(ctx)
	sb := newSandbox(Config{Spec: spec, RunDir: d.cfg.RunDir, Cache: d.cfg.Cache, AgentPath: d.cfg.AgentPath,
		Kernel: k, Cgroups: d.cfg.Cgroups, Accel: accel, Log: d.cfg.Log})
	sb.stopping = true
	var err error
	if networked {
		sb.ids, err = state.ReserveSlot(slot)
	} else {
		sb.ids, err = state.ReserveIDs()
	}
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", spec.ID, err)
	}
	if err := state.Remove(d.cfg.RunDir, d.cfg.Cgroups, spec.ID); err != nil {
		sb.ids.Release()
		return nil, fmt.Errorf("sandbox %s: %w", spec.ID, err)
	}
	if networked {
		// Rules and interfaces a restore cut short may have left.
		if n, err := spec.Net.Adopt(spec.ID, slot, spec.NetPolicy); err == nil {
			_ = n.Close()
		}
	}
	if err := sb.vmConfig(); err != nil {
		sb.ids.Release()
		return nil, fmt.Errorf("sandbox %s: %w", spec.ID, err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, checkpointShape)); err == nil {
		var meta checkpointMeta
		if json.Unmarshal(b, &meta) == nil {
			sb.restored = meta.NamedRAM
		}
	}
	return sb, nil
}
