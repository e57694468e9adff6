// Package spawner starts the process wall's agents from a small helper
// process instead of from the daemon.
//
// An agent is born in a new user namespace (with its pid, mount, net, ipc
// and uts namespaces), and a fork into a new user namespace cannot share
// its parent's memory: Go then forks without CLONE_VM, and the kernel
// copies the page tables of the whole forking process and write-protects
// every page of it, so that the parent then takes a fault on each page it
// writes, and every CPU running one of its threads a TLB shootdown. For a
// daemon with hundreds of sandboxes alive (a heap of 50-150 MiB) that was
// the largest single cost of a create after nftables, and it grew with the
// sandboxes alive. The spawner is cage-agent run as `cage-agent spawner`
// on the host, beside the daemon: a few MiB, single-purpose, started once.
// The daemon sends it each agent to start over a socket pair (the request
// as JSON, its descriptors as SCM_RIGHTS); it forks from itself, puts the
// child in its cgroups as the daemon would (cgroups.Spawn), and answers
// with the pid and a pidfd, through which the daemon watches and kills the
// agent as it does an adopted one. It reaps its children and reports how
// each ended.
//
// The spawner trusts its one peer, the daemon that started it (the socket
// pair has no name; nothing else can reach it), and holds nothing a
// sandbox can reach: the descriptors a child gets are exactly those of its
// request. It exits when the daemon's end of the socket closes (the daemon
// exited or died); agents it started then belong to init, as they would if
// the daemon itself had started them, and a new daemon adopts them.
package spawner

import (
	"encoding/json"
	"errors"
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"
)

// Request is one process to start.
type Request struct {
	ID         uint64                 `json:"id"`
	Path       string                 `json:"path"`
	Argv       []string               `json:"argv"`
	Env        []string               `json:"env"`
	Dir        string                 `json:"dir"`
	Cloneflags uintptr                `json:"cloneflags"`
	UIDMaps    []syscall.SysProcIDMap `json:"uid_maps,omitempty"`
	GIDMaps    []syscall.SysProcIDMap `json:"gid_maps,omitempty"`
	Setgroups  bool                   `json:"setgroups"`
	Setsid     bool                   `json:"setsid"`
	// CgroupParent and Cgroup name the group the child is born in
	// (cgroups.Manager's parent, the sandbox's group); "" for none.
	CgroupParent string `json:"cgroup_parent,omitempty"`
	Cgroup       string `json:"cgroup,omitempty"`
	// Nice is the child's priority (0: the spawner's own).
	Nice int `json:"nice,omitempty"`
	// Files is how many descriptors come with the request: the child's
	// 0..Files-1, in order.
	Files int `json:"files"`
}

// reply is the spawner's answer to a request, or (Exit set) the end of a
// child it started.
type reply struct {
	ID    uint64 `json:"id,omitempty"`
	PID   int    `json:"pid,omitempty"`
	Errno int    `json:"errno,omitempty"` // the fork's error number, if it has one
	Err   string `json:"err,omitempty"`
	// Exit: the pid of a child that ended, and its wait status.
	Exit   int    `json:"exit,omitempty"`
	Status uint32 `json:"status,omitempty"`
}

// maxMessage bounds one message (a request's environment and id maps are
// small; a larger message is an error, never a partial read).
const maxMessage = 64 << 10

// maxFiles bounds the descriptors of one request.
const maxFiles = 16

// send writes one message with its descriptors.
func send(fd int, v any, files []int) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if len(b) > maxMessage {
		return fmt.Errorf("spawner: message of %d bytes is too large", len(b))
	}
	var oob []byte
	if len(files) > 0 {
		oob = unix.UnixRights(files...)
	}
	for {
		err = unix.Sendmsg(fd, b, oob, nil, 0)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// receiver reads the messages of one socket, from one goroutine: its
// buffers serve every message (a fresh 64 KiB buffer per message was a
// page-faulting allocation per create in the daemon and in the spawner,
// where pages written while a forked child still shares them are copied).
type receiver struct{ buf, oob []byte }

func newReceiver() *receiver {
	return &receiver{buf: make([]byte, maxMessage+1), oob: make([]byte, unix.CmsgSpace(maxFiles*4))}
}

// recv reads one message and the descriptors that came with it (made
// close-on-exec by the kernel as they arrive). v keeps nothing of the
// buffer: JSON decoding copies what it keeps.
func (rc *receiver) recv(fd int, v any) ([]int, error) {
	buf, oob := rc.buf, rc.oob
	var n, oobn, flags int
	var err error
	for {
		n, oobn, flags, _, err = unix.Recvmsg(fd, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		return nil, err
	}
	var files []int
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return nil, err
		}
		for _, m := range msgs {
			fds, err := unix.ParseUnixRights(&m)
			if err != nil {
				closeAll(files)
				return nil, err
			}
			files = append(files, fds...)
		}
	}
	if n == 0 && oobn == 0 {
		return nil, errClosed
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 || n > maxMessage {
		closeAll(files)
		return nil, errors.New("spawner: message truncated")
	}
	if err := json.Unmarshal(buf[:n], v); err != nil {
		closeAll(files)
		return nil, fmt.Errorf("spawner: malformed message: %w", err)
	}
	return files, nil
}

var errClosed = errors.New("spawner: connection closed")

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}
