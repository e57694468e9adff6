package clitest

import (
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"

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

// connectAsNobody connects to the unix socket at path from a thread whose
// ids are all 65534 and which holds no group and no capability (the
// thread is thrown away after).
func connectAsNobody(path string) error {
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread goes with the goroutine
		for _, c := range [][4]uintptr{{unix.SYS_SETGROUPS, 0, 0, 0}, {unix.SYS_SETRESGID, 65534, 65534, 65534}, {unix.SYS_SETRESUID, 65534, 65534, 65534}} {
			if _, _, errno := unix.RawSyscall(c[0], c[1], c[2], c[3]); errno != 0 {
				done <- errno
				return
			}
		}
		var err error
		for _, typ := range []int{unix.SOCK_STREAM, unix.SOCK_SEQPACKET, unix.SOCK_DGRAM} {
			fd, serr := unix.Socket(unix.AF_UNIX, typ|unix.SOCK_CLOEXEC, 0)
			if serr != nil {
				done <- serr
				return
			}
			err = unix.Connect(fd, &unix.SockaddrUnix{Name: path})
			unix.Close(fd)
			if !errors.Is(err, unix.EPROTOTYPE) {
				break
			}
		}
		done <- err
	}()
	return <-done
}
