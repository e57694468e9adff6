// Command heldprobe is what a compromised agent could do with the slot's
// lock file it is passed (oci TestGVisorHeldLock): each operation on the
// descriptor named by its argument, and its result, a line each.
package main

import (
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

func main() {
	fd, err := strconv.Atoi(os.Args[1])
	if err != nil {
		fmt.Println("usage: heldprobe FD")
		os.Exit(2)
	}
	try := func(what string, err error) { fmt.Printf("%s: %v\n", what, err) }
	try("fchmod", unix.Fchmod(fd, 0o4777))
	try("fchown", unix.Fchown(fd, 1234, 1234))
	try("ftruncate", unix.Ftruncate(fd, 4096))
	_, err = unix.Pwrite(fd, []byte("written"), 0)
	try("pwrite", err)
	try("fallocate", unix.Fallocate(fd, 0, 0, 1<<20))
	try("futimens", unix.UtimesNanoAt(fd, "", []unix.Timespec{{Sec: 1}, {Sec: 1}}, unix.AT_EMPTY_PATH))
	try("fsetxattr", unix.Fsetxattr(fd, "user.x", []byte("1"), 0))
	for _, fl := range []int{unix.O_RDWR, unix.O_WRONLY | unix.O_TRUNC} {
		f, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", fd), fl, 0)
		try(fmt.Sprintf("reopen %#o", fl), err)
		if err == nil {
			_, err = unix.Write(f, []byte("written"))
			try("write to the reopened", err)
			try("fchmod the reopened", unix.Fchmod(f, 0o777))
			unix.Close(f)
		}
	}
	_, err = unix.Openat(fd, "..", unix.O_RDONLY|unix.O_DIRECTORY, 0)
	try("openat ..", err)
	try("linkat", unix.Linkat(fd, "", unix.AT_FDCWD, "/tmp/link", unix.AT_EMPTY_PATH))
	fmt.Println("done")
}
