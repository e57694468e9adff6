// Command guestinit is the tests' stand-in for the agent: PID 1 of the
// guest, it says hello on the agent port and echoes back every line it
// reads, until the host goes away.
package main

import (
	"bufio"
	"fmt"
	"os"

	"github.com/cagehq/cage/internal/vm"
	"golang.org/x/sys/unix"
)

func main() {
	port, err := vm.GuestSetup()
	if err != nil {
		fail(err)
	}
	// Blocks until the host has connected.
	if _, err := port.WriteString("hello from the guest\n"); err != nil {
		fail(err)
	}
	r := bufio.NewReader(port)
	for {
		line, err := r.ReadString('\n')
		if line != "" {
			if _, err := port.WriteString(line); err != nil {
				fail(err)
			}
		}
		if err != nil {
			// EOF: the host has hung up. The VM has nothing more to do.
			poweroff()
		}
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "guestinit:", err)
	poweroff()
}

// poweroff ends the VM: a restart, which QEMU's -no-reboot makes an exit.
// PID 1 must not simply return, which would be a kernel panic.
func poweroff() {
	unix.Sync()
	_ = unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
	select {}
}
