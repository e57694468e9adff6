package microvm

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/vm"
)

// Config describes one sandbox to create.
type Config struct {
	ID        string
	RunDir    string
	AgentPath string // the static cage-agent: the guest's init
	Kernel    *vm.Kernel
	Template  *template.Template // an image template
	MemoryMB  int
	CPUs      int
	DiskBytes int64
	Token     string
	Env       map[string]string
	MaxOutput int64
	Threads   int
	Log       *slog.Logger // slog.Default() when nil

	coldBoot bool // boot, do not restore (tests compare the two)
}

func logger(cfg Config) *slog.Logger {
	if cfg.Log != nil {
		return cfg.Log
	}
	return slog.Default()
}

// Sandbox is a running microvm sandbox, seen from the host.
type Sandbox struct {
	id, token string
	dir       string
	v         *vm.VM
	sess      *yamux.Session
	restored  bool // from a snapshot, not booted cold
}

// ID is the sandbox's id.
func (sb *Sandbox) ID() string { return sb.id }

// Token is the agent's access token.
func (sb *Sandbox) Token() string { return sb.token }

// Dial opens a connection to the agent: a stream of the session.
func (sb *Sandbox) Dial(ctx context.Context) (net.Conn, error) {
	c, err := sb.sess.Open()
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", sb.id, err)
	}
	return c, nil
}

// Exited is closed once the VM has ended.
func (sb *Sandbox) Exited() <-chan struct{} { return sb.v.Exited() }

// Destroy stops the VM and removes its directory.
func (sb *Sandbox) Destroy() error {
	if sb.sess != nil {
		sb.sess.Close()
	}
	if sb.v != nil {
		sb.v.Stop()
	}
	return os.RemoveAll(sb.dir)
}

// Create starts a sandbox's VM and its agent. The VM is restored from the
// snapshot of its shape, made by the first Create of that shape; a VM
// boots cold only if the snapshot cannot be made. On error nothing is
// left behind.
func Create(ctx context.Context, cfg Config) (sb *Sandbox, err error) {
	if cfg.Template == nil || cfg.Template.Image == nil {
		return nil, errors.New("the microvm wall runs image templates only (not host)")
	}
	sb = &Sandbox{id: cfg.ID, token: cfg.Token, dir: filepath.Join(cfg.RunDir, "sandboxes", cfg.ID)}
	defer func() {
		if err != nil {
			_ = sb.Destroy()
			sb = nil
		}
	}()
	cache := filepath.Join(cfg.RunDir, "microvm")
	initrd, err := Initramfs(cache, cfg.Kernel, cfg.AgentPath)
	if err != nil {
		return sb, err
	}
	disk, err := TemplateImage(cache, cfg.Template)
	if err != nil {
		return sb, err
	}
	if err := os.MkdirAll(sb.dir, 0o700); err != nil {
		return sb, err
	}
	vcfg := vm.Config{Kernel: cfg.Kernel, Initramfs: initrd, MemoryMB: cfg.MemoryMB, CPUs: cfg.CPUs,
		Dir: sb.dir, Disks: []string{disk}}
	if !cfg.coldBoot {
		snap, serr := cachedSnapshot(ctx, cache, vcfg)
		if serr == nil {
			if sb.v, err = vm.Restore(ctx, snap.restoreConfig(vcfg), snap.state()); err != nil {
				return sb, err
			}
			sb.restored = true
		} else {
			if ctx.Err() != nil {
				return sb, ctx.Err()
			}
			logger(cfg).Warn("microvm: no snapshot, booting cold", "sandbox", cfg.ID, "err", serr)
		}
	}
	if sb.v == nil {
		if sb.v, err = vm.Start(ctx, vcfg); err != nil {
			return sb, err
		}
	}
	if sb.sess, err = greet(ctx, sb.v); err != nil {
		return sb, err
	}
	first, err := sb.sess.Open()
	if err != nil {
		return sb, err
	}
	defer first.Close()
	hostname := "cage-" + cfg.ID[:min(8, len(cfg.ID))]
	// Every guest gets its own random bytes and the time, restored or not:
	// see spec.
	entropy := make([]byte, entropyBytes)
	if _, err := rand.Read(entropy); err != nil {
		return sb, err
	}
	if err := json.NewEncoder(first).Encode(spec{Token: cfg.Token, Env: cfg.Env, MaxOutput: cfg.MaxOutput,
		Hostname: hostname, DiskBytes: cfg.DiskBytes, Threads: cfg.Threads,
		Entropy: entropy, UnixNano: time.Now().UnixNano()}); err != nil {
		return sb, err
	}
	if err := readLine(ctx, first, bufio.NewReader(first), ready); err != nil {
		return sb, fmt.Errorf("the guest's agent did not start: %w (%s)", err, consoleTail(sb.dir))
	}
	return sb, nil
}

// readLine reads one line from r and checks it is want.
func readLine(ctx context.Context, c net.Conn, r *bufio.Reader, want string) error {
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetReadDeadline(dl)
		defer c.SetReadDeadline(time.Time{})
	}
	line, err := r.ReadString('\n')
	if err != nil {
		return err
	}
	if line != want {
		return fmt.Errorf("%s", strings.TrimSpace(line))
	}
	return nil
}

func consoleTail(dir string) string {
	b, _ := os.ReadFile(filepath.Join(dir, vm.ConsoleLog))
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return "console: " + strings.Join(lines[max(0, len(lines)-3):], " | ")
}

// Initramfs returns the guest's initramfs for kernel k with the agent as
// init, built once per agent binary and kernel into dir.
func Initramfs(dir string, k *vm.Kernel, agentPath string) (string, error) {
	sum, err := fileSum(agentPath)
	if err != nil {
		return "", err
	}
	name := "initramfs-" + k.Version + "-" + sum[:16] + ".cpio"
	p := filepath.Join(dir, name)
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	f, err := os.CreateTemp(dir, ".initramfs-*")
	if err != nil {
		return "", err
	}
	defer os.Remove(f.Name())
	modules := append(append([]string(nil), vm.DefaultModules...), "ext4", "overlay")
	err = vm.WriteInitramfs(f, k, agentPath, modules)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", err
	}
	return p, os.Rename(f.Name(), p)
}

func fileSum(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// TemplateImage returns the read-only ext4 image of template t's files,
// built once per template ID into dir: its layers merged by a read-only
// overlay on the host, copied by mke2fs -d (owners and modes kept).
func TemplateImage(dir string, t *template.Template) (string, error) {
	p := filepath.Join(dir, "images", t.Image.Info.ID[len("sha256:"):][:24]+".ext4")
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return "", err
	}
	unlock, err := t.Image.Store.RLock()
	if err != nil {
		return "", err
	}
	defer unlock()
	layers, err := t.Image.Store.LayerDirs(t.Image.Info)
	if err != nil {
		return "", err
	}
	merged, err := os.MkdirTemp(dir, ".merged-")
	if err != nil {
		return "", err
	}
	defer os.Remove(merged)
	if len(layers) == 1 {
		err = unix.Mount(layers[0], merged, "", unix.MS_BIND|unix.MS_RDONLY, "")
	} else {
		var top []string
		for i := len(layers) - 1; i >= 0; i-- {
			top = append(top, layers[i])
		}
		err = unix.Mount(imgstore.MountSource(t.Image.Info), merged, "overlay", unix.MS_RDONLY, "lowerdir="+strings.Join(top, ":"))
	}
	if err != nil {
		return "", fmt.Errorf("merge the template's layers: %w", err)
	}
	defer unix.Unmount(merged, unix.MNT_DETACH)
	// Size: the files plus a third, at least 64 MiB; inodes: one per file
	// and some.
	size := max(64<<20, t.Image.Info.Size*4/3+32<<20)
	tmp := p + ".tmp"
	_ = os.Remove(tmp)
	out, err := exec.Command("mke2fs", "-q", "-t", "ext4", "-O", "^has_journal", "-m", "0", "-E", "root_owner=0:0",
		"-d", merged, tmp, strconv.FormatInt(size/1024, 10)+"k").CombinedOutput()
	if err != nil {
		_ = os.Remove(tmp)
		return "", fmt.Errorf("mke2fs: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return p, os.Rename(tmp, p)
}
