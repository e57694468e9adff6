package cgroups

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"
)

// A new process is best born in its group: moving it in after the fork
// takes the kernel's global cgroup_threadgroup_rwsem for writing, and on
// a host without favordynmods the first writer after an idle spell waits
// for an RCU grace period (≈ 10 ms on these hosts, far more under load).
// On v2 clone3 takes the group (CLONE_INTO_CGROUP). On v1 a thread may
// move itself ("0" written to a group's tasks file) without that lock
// (Linux 6.0: a single thread moving itself cannot race a fork or exit of
// its group), and a process forks into the groups of the thread that forks
// it: Spawn forks from a thread of its own that steps into the group for
// the moment of the fork and back out.

// Spawn runs start, which starts a process and returns its pid, so that
// the process is in the group when it begins. On v2 start gets the group's
// directory for clone3's CLONE_INTO_CGROUP (syscall.SysProcAttr's
// UseCgroupFD and CgroupFD), else -1. start runs on a locked OS thread (a
// parent-death signal follows the thread that forks) that lives on after.
// Where neither way is open (this process's groups out of its view), the
// process is moved in after the fork.
func (cg *Cgroup) Spawn(start func(cgroupFD int) (int, error)) (int, error) {
	type result struct {
		pid   int
		moved bool // start ran on a thread inside the group
		err   error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		var r result
		restored := true
		defer func() {
			done <- r
			if restored {
				runtime.UnlockOSThread()
			}
			// Else the goroutine ends locked, and the thread (in the
			// sandbox's group) ends with it.
		}()
		if cg.m.Mode == V2 {
			fd, err := unix.Open(cg.dirs["unified"], unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			if err != nil {
				r.err = fmt.Errorf("open cgroup %s: %w", cg.dirs["unified"], err)
				return
			}
			defer unix.Close(fd)
			r.pid, r.err = start(fd)
			if !errors.Is(r.err, unix.ENOSYS) { // no clone3: fork, then move
				r.moved = true
				return
			}
			r.pid, r.err = start(-1)
			return
		}
		back, err := cg.enterThread()
		if err != nil {
			r.pid, r.err = start(-1)
			return
		}
		r.pid, r.err = start(-1)
		r.moved = true
		if err := back(); err != nil {
			restored = false
		}
	}()
	r := <-done
	if r.err != nil || r.moved {
		return r.pid, r.err
	}
	return r.pid, cg.AddProc(r.pid)
}

// enterThread moves the calling (locked) thread into the group in every
// v1 hierarchy the group has, and returns what moves it back. Nothing is
// moved when this thread's own groups cannot all be named.
func (cg *Cgroup) enterThread() (back func() error, err error) {
	own, err := threadGroups()
	if err != nil {
		return nil, err
	}
	var from []string // where this thread was, for each hierarchy entered
	back = func() error {
		var errs []error
		for _, dir := range from {
			errs = append(errs, os.WriteFile(filepath.Join(dir, "tasks"), []byte("0"), 0))
		}
		return errors.Join(errs...)
	}
	for ctrl, dir := range cg.dirs {
		mnt := cg.m.v1[ctrl]
		rel, ok := own[ctrl]
		if mnt == "" || !ok {
			_ = back()
			return nil, fmt.Errorf("this thread's %s group is out of view", ctrl)
		}
		orig := filepath.Join(mnt, rel)
		if _, err := os.Stat(filepath.Join(orig, "tasks")); err != nil {
			_ = back()
			return nil, err // not the group this thread can return to
		}
		if err := os.WriteFile(filepath.Join(dir, "tasks"), []byte("0"), 0); err != nil {
			_ = back()
			return nil, err
		}
		from = append(from, orig)
	}
	return back, nil
}

// threadGroups maps each v1 controller to the calling thread's group in
// its hierarchy, relative to the hierarchy's root as this process's cgroup
// namespace shows it; a group outside that view is left out.
func threadGroups() (map[string]string, error) {
	f, err := os.Open("/proc/thread-self/cgroup")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// hierarchy-id:controllers:path
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 || parts[1] == "" {
			continue
		}
		p := parts[2]
		if !strings.HasPrefix(p, "/") || strings.Contains(p, "/..") || strings.HasSuffix(p, " (deleted)") {
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			out[c] = p
		}
	}
	return out, sc.Err()
}
