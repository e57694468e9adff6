package agent

import (
	"os"
	"runtime"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// spawner forks every process the agent starts from one dedicated OS thread.
// Credentials are per thread in Linux, and a child inherits its forking
// thread's: a wall can give this one thread state that would be costly to
// give every Go thread (the process wall shrinks its capability bounding set
// and sets securebits here, see Config.SpawnThreadSetup).
type spawner struct {
	reqs chan spawnReq
	gate chan struct{} // closed when the first fork may happen
}

type spawnReq struct {
	bin   string
	argv  []string
	attr  *syscall.ProcAttr
	reply chan spawnResult
}

type spawnResult struct {
	pid int
	err error
}

// newSpawner starts the spawning thread and runs setup on it first.
func newSpawner(setup func() error) (*spawner, error) {
	s := &spawner{reqs: make(chan spawnReq), gate: make(chan struct{})}
	ready := make(chan error, 1)
	go func() {
		// Never unlocked: the thread carries the setup's state for good,
		// and the runtime will not clone new threads from a locked one.
		runtime.LockOSThread()
		if setup != nil {
			if err := setup(); err != nil {
				ready <- err
				return
			}
		}
		ready <- nil
		<-s.gate
		for r := range s.reqs {
			dumpable, _ := unix.PrctlRetInt(unix.PR_GET_DUMPABLE, 0, 0, 0, 0)
			pid, err := syscall.ForkExec(r.bin, r.argv, r.attr)
			if dumpable == 1 {
				// The child shares the agent's memory until it execs (vfork),
				// and its setuid resets the dumpable flag of that memory:
				// restore it, or /proc/1 would belong to sandbox root.
				_ = unix.Prctl(unix.PR_SET_DUMPABLE, 1, 0, 0, 0)
			}
			if err == nil {
				preferAsOOMVictim(pid)
			}
			r.reply <- spawnResult{pid, err}
		}
	}()
	if err := <-ready; err != nil {
		return nil, err
	}
	return s, nil
}

func (s *spawner) forkExec(bin string, argv []string, attr *syscall.ProcAttr) (int, error) {
	reply := make(chan spawnResult, 1)
	s.reqs <- spawnReq{bin: bin, argv: argv, attr: attr, reply: reply}
	r := <-reply
	return r.pid, r.err
}

// commandOOMScoreAdj is what every process the agent starts (and what
// they start) adds to its OOM badness: half the group's memory. The
// sandbox's memory group holds the agent and its commands, and memory
// that a command holds in the kernel (socket buffers, tmpfs files) counts
// to the group but to no process: the OOM killer then took the agent, the
// group's largest member, and the whole sandbox with it. With this it
// takes a command, which frees what it held. A command cannot lower it
// (that takes CAP_SYS_RESOURCE in the host's namespace); in an OOM of the
// host, sandboxes' commands go before the host's own processes.
const commandOOMScoreAdj = "500"

func preferAsOOMVictim(pid int) {
	_ = os.WriteFile("/proc/"+strconv.Itoa(pid)+"/oom_score_adj", []byte(commandOOMScoreAdj), 0)
}
