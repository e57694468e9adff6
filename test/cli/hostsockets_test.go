package clitest

import (
	"errors"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// TestHostUsersCannotConnectToSandboxSockets: no socket that cage or its
// runtimes make under the run directory (the agent's, runsc's control
// socket, the gVisor channel) takes a connection from another host user,
// even from a cage started under umask 000, which makes every socket
// 0777. Found by review, 2026-12-03: runsc made RUN/gvisor 0711 and its
// control socket runsc-ID.sock with the daemon's umask, and an
// unprivileged user connected and ran `id` as root in the sandbox
// (containerManager.ExecuteAsync).
func TestHostUsersCannotConnectToSandboxSockets(t *testing.T) {
	for _, wall := range []string{"process", "runc", "gvisor"} {
		t.Run(wall, func(t *testing.T) {
			e := setup(t)
			if wall != "process" {
				bin := map[string]string{"runc": "runc", "gvisor": "runsc"}[wall]
				if _, err := exec.LookPath(bin); err != nil && os.Getenv("CAGE_RUNSC") == "" {
					testutil.SkipWall(t, wall, "%s not installed", bin)
				}
			}
			old := syscall.Umask(0)
			l := e.startCageEnv(nil, "run", "--wall", wall, "--", "sh", "-c", "echo READY; sleep 30")
			syscall.Umask(old)
			defer func() {
				_ = l.cmd.Process.Signal(os.Interrupt)
				l.wait(t)
				e.noLeftovers()
			}()
			var socks []string
			_ = filepath.WalkDir(e.runDir, func(p string, d fs.DirEntry, err error) error {
				if err == nil && d.Type()&fs.ModeSocket != 0 {
					socks = append(socks, p)
				}
				return nil
			})
			if len(socks) == 0 {
				t.Fatalf("no socket under %s: this test would prove nothing", e.runDir)
			}
			for _, p := range socks {
				if err := connectAsNobody(p); err == nil {
					t.Errorf("a host user (uid 65534) connected to %s", p)
				} else if !errors.Is(err, unix.EACCES) {
					t.Errorf("%s: %v, want EACCES", p, err)
				}
			}
		})
	}
}

// connectAsNobody connects to the unix socket at path as a host user.
func connectAsNobody(path string) error {
	return asNobody(func() error {
		var err error
		for _, typ := range []int{unix.SOCK_STREAM, unix.SOCK_SEQPACKET, unix.SOCK_DGRAM} {
			fd, serr := unix.Socket(unix.AF_UNIX, typ|unix.SOCK_CLOEXEC, 0)
			if serr != nil {
				return serr
			}
			err = unix.Connect(fd, &unix.SockaddrUnix{Name: path})
			unix.Close(fd)
			if !errors.Is(err, unix.EPROTOTYPE) {
				break
			}
		}
		return err
	})
}

// asNobody runs fn on a thread whose ids are all 65534 and which holds no
// group and no capability (the thread is thrown away after).
func asNobody(fn func() error) error {
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread goes with the goroutine
		for _, c := range [][4]uintptr{{unix.SYS_SETGROUPS, 0, 0, 0}, {unix.SYS_SETRESGID, 65534, 65534, 65534}, {unix.SYS_SETRESUID, 65534, 65534, 65534}} {
			if _, _, errno := unix.RawSyscall(c[0], c[1], c[2], c[3]); errno != 0 {
				done <- errno
				return
			}
		}
		done <- fn()
	}()
	return <-done
}

// TestHostUsersCannotReachSandboxAddress: a host user's process reaches
// no sandbox at its address (its servers are reached through the proxy,
// with its credentials); root's still does. Found by review, 2026-12-03:
// an unprivileged user's curl got 200 from a networked sandbox's server at
// 10.209.x.y:8080, past the traffic token and the audit trail.
func TestHostUsersCannotReachSandboxAddress(t *testing.T) {
	for _, wall := range []string{"process", "runc"} {
		t.Run(wall, func(t *testing.T) {
			e := setup(t)
			if wall == "runc" {
				if _, err := exec.LookPath("runc"); err != nil {
					testutil.SkipWall(t, wall, "runc not installed")
				}
			}
			l := e.startCageEnv(nil, "run", "--wall", wall, "--net", "internet", "--", "sh", "-c",
				`echo READY; ip -4 -o addr show dev eth0; exec python3 -c 'import socket,time
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 8080)); s.listen(16)
while True: c,_=s.accept(); c.close()'`)
			defer func() {
				_ = l.cmd.Process.Signal(os.Interrupt)
				l.wait(t)
			}()
			var addr string
			for deadline := time.Now().Add(10 * time.Second); addr == "" && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
				if m := regexp.MustCompile(`inet (\d+\.\d+\.\d+\.\d+)/`).FindStringSubmatch(l.output()); m != nil {
					addr = m[1] + ":8080"
				}
			}
			if addr == "" {
				t.Fatalf("no address in %q", l.output())
			}
			dial := func() error {
				c, err := net.DialTimeout("tcp4", addr, 2*time.Second)
				if err == nil {
					c.Close()
				}
				return err
			}
			var err error
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
				if err = dial(); err == nil {
					break
				}
			}
			if err != nil {
				t.Fatalf("root could not reach the sandbox's server at %s either: %v (this test would prove nothing)", addr, err)
			}
			if err := asNobody(dial); err == nil {
				t.Errorf("a host user (uid 65534) connected to the sandbox's server at %s", addr)
			}
		})
	}
}
