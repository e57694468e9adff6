// Command guestinit is the tests' stand-in for the agent: PID 1 of the
// guest, it says hello on the agent port and echoes back every line it
// reads, until the host goes away.
package main

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/vm/boot"
)

func main() {
	port, err := boot.GuestSetup()
	if err != nil {
		fail(err)
	}
	flood()
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

// flood writes cage.flood=N bytes (a kernel argument) to the console,
// numbered lines, the last "flood-end": a guest that floods its console.
func flood() {
	cmdline, _ := os.ReadFile("/proc/cmdline")
	for _, arg := range strings.Fields(string(cmdline)) {
		if v, ok := strings.CutPrefix(arg, "cage.flood="); ok {
			n, _ := strconv.Atoi(v)
			con, err := os.OpenFile("/dev/console", os.O_WRONLY, 0)
			if err != nil {
				fail(err)
			}
			w := bufio.NewWriterSize(con, 1<<16)
			for i := 0; i < n; {
				k, _ := fmt.Fprintf(w, "flood line %09d\n", i)
				i += k
			}
			fmt.Fprintln(w, "flood-end")
			w.Flush()
			con.Close()
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
