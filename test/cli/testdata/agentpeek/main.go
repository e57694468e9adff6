// agentpeek runs as a RUN step of a template build (root, with the build
// sandbox's capabilities) and tries what a hostile step would: take the
// agent's uid while keeping its capabilities, then open the agent's
// memory for writing. It prints what each step got; the test reads it.
package main

import (
	"fmt"
	"runtime"
	"syscall"
	"unsafe"
)

const agentUID = 65533 // inside.AgentUID

func main() {
	runtime.LockOSThread() // credentials are per thread: every step on this one
	step := func(name string, trap, a1, a2, a3 uintptr) bool {
		if _, _, e := syscall.RawSyscall(trap, a1, a2, a3); e != 0 {
			fmt.Printf("%s: %v\n", name, e)
			return false
		}
		return true
	}
	const prSetKeepcaps = 8
	if !step("keepcaps", syscall.SYS_PRCTL, prSetKeepcaps, 1, 0) ||
		!step("setresgid", syscall.SYS_SETRESGID, agentUID, agentUID, agentUID) ||
		!step("setresuid", syscall.SYS_SETRESUID, agentUID, agentUID, agentUID) {
		return
	}
	// The change of uid cleared the effective set: raise it to the
	// permitted one, which KEEPCAPS kept.
	hdr := struct {
		version uint32
		pid     int32
	}{0x20080522, 0}
	var data [2]struct{ effective, permitted, inheritable uint32 }
	if !step("capget", syscall.SYS_CAPGET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0) {
		return
	}
	data[0].effective, data[1].effective = data[0].permitted, data[1].permitted
	if !step("capset", syscall.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0) {
		return
	}
	fmt.Printf("as the agent's uid, capabilities %08x%08x\n", data[1].effective, data[0].effective)
	fd, err := syscall.Open("/proc/1/mem", syscall.O_RDWR, 0)
	if err != nil {
		fmt.Printf("agent memory: refused (%v)\n", err)
		return
	}
	syscall.Close(fd)
	fmt.Println("agent memory: opened for writing")
}
