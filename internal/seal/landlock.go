package seal

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Landlock, where the kernel has it, as a second lock behind the
// read-only mounts: the sandbox may write only its own storage, /dev's
// harmless nodes and its own /proc entries, and read or execute the rest.
// (/root is writable for root inside; it lives on the sandbox disk.)

// Filesystem rights by ABI version.
const (
	llRightsV1 = unix.LANDLOCK_ACCESS_FS_EXECUTE | unix.LANDLOCK_ACCESS_FS_WRITE_FILE |
		unix.LANDLOCK_ACCESS_FS_READ_FILE | unix.LANDLOCK_ACCESS_FS_READ_DIR |
		unix.LANDLOCK_ACCESS_FS_REMOVE_DIR | unix.LANDLOCK_ACCESS_FS_REMOVE_FILE |
		unix.LANDLOCK_ACCESS_FS_MAKE_CHAR | unix.LANDLOCK_ACCESS_FS_MAKE_DIR |
		unix.LANDLOCK_ACCESS_FS_MAKE_REG | unix.LANDLOCK_ACCESS_FS_MAKE_SOCK |
		unix.LANDLOCK_ACCESS_FS_MAKE_FIFO | unix.LANDLOCK_ACCESS_FS_MAKE_BLOCK |
		unix.LANDLOCK_ACCESS_FS_MAKE_SYM
	llRefer    = unix.LANDLOCK_ACCESS_FS_REFER     // ABI 2
	llTruncate = unix.LANDLOCK_ACCESS_FS_TRUNCATE  // ABI 3
	llIoctlDev = unix.LANDLOCK_ACCESS_FS_IOCTL_DEV // ABI 5

	llRead = unix.LANDLOCK_ACCESS_FS_EXECUTE | unix.LANDLOCK_ACCESS_FS_READ_FILE | unix.LANDLOCK_ACCESS_FS_READ_DIR
)

// landlockABI returns the kernel's Landlock ABI version, 0 when absent.
func landlockABI() int {
	v, _, errno := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, 0, 0, unix.LANDLOCK_CREATE_RULESET_VERSION)
	if errno != 0 {
		return 0
	}
	return int(v)
}

func handledRights(abi int) uint64 {
	r := uint64(llRightsV1)
	if abi >= 2 {
		r |= llRefer
	}
	if abi >= 3 {
		r |= llTruncate
	}
	if abi >= 5 {
		r |= llIoctlDev
	}
	return r
}

// applyLandlock restricts every thread of the agent, and so every process it
// starts. It returns the ABI used (0: the kernel has no Landlock).
func applyLandlock(writableRoot bool, more, readable []string) (int, error) {
	abi := landlockABI()
	if abi == 0 {
		return 0, nil
	}
	handled := handledRights(abi)
	attr := unix.LandlockRulesetAttr{Handled_access_fs: handled}
	fd, _, errno := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr), 0)
	if errno != 0 {
		return abi, fmt.Errorf("landlock_create_ruleset: %w", errno)
	}
	defer unix.Close(int(fd))

	writable := handled &^ (unix.LANDLOCK_ACCESS_FS_MAKE_CHAR | unix.LANDLOCK_ACCESS_FS_MAKE_BLOCK)
	devRW := (llRead | unix.LANDLOCK_ACCESS_FS_WRITE_FILE | llTruncate | llIoctlDev) & handled
	rules := []struct {
		path   string
		access uint64
	}{
		{"/", llRead},
		{"/tmp", writable},
		{"/var/tmp", writable},
		{"/home", writable},
		{"/root", writable},
		{"/dev", devRW},
		{"/dev/shm", writable},
		{"/proc", (llRead | unix.LANDLOCK_ACCESS_FS_WRITE_FILE | llTruncate) & handled},
	}
	if writableRoot {
		rules[0].access = writable
	}
	for _, p := range more {
		rules = append(rules, struct {
			path   string
			access uint64
		}{p, writable})
	}
	for _, p := range readable {
		rules = append(rules, struct {
			path   string
			access uint64
		}{p, llRead & handled})
	}
	for _, r := range rules {
		if err := landlockAllow(int(fd), r.path, r.access); err != nil {
			return abi, err
		}
	}
	if err := allThreads(unix.SYS_LANDLOCK_RESTRICT_SELF, fd, 0, 0); err != nil {
		return abi, fmt.Errorf("landlock_restrict_self: %w", err)
	}
	return abi, nil
}

func landlockAllow(rulesetFD int, path string, access uint64) error {
	pfd, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("landlock rule %s: %w", path, err)
	}
	defer unix.Close(pfd)
	rule := unix.LandlockPathBeneathAttr{Allowed_access: access, Parent_fd: int32(pfd)}
	_, _, errno := unix.Syscall6(unix.SYS_LANDLOCK_ADD_RULE, uintptr(rulesetFD), unix.LANDLOCK_RULE_PATH_BENEATH,
		uintptr(unsafe.Pointer(&rule)), 0, 0, 0)
	if errno != 0 {
		return fmt.Errorf("landlock rule %s: %w", path, errno)
	}
	return nil
}
