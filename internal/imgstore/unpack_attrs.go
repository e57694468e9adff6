package imgstore

import (
	"archive/tar"
	"fmt"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// attrs sets an entry's xattrs, owner and mode on its open descriptor, in
// that order: chown clears setuid and setgid, so the mode comes last.
func (u *unpacker) attrs(fd int, name string, hdr *tar.Header) error {
	for _, x := range u.keptXattrs(hdr) {
		if err := unix.Fsetxattr(fd, x[0], []byte(x[1]), 0); err != nil {
			return fmt.Errorf("%s: %s: xattr %s: %w", u.label, name, x[0], err)
		}
	}
	if err := unix.Fchown(fd, hdr.Uid, hdr.Gid); err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, name, err)
	}
	if err := unix.Fchmod(fd, uint32(hdr.Mode&0o7777)); err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, name, err)
	}
	return nil
}

// keptXattrs returns the entry's user.* xattrs, sorted. Everything else is
// dropped and counted: trusted.* (trusted.overlay.* would steer overlayfs),
// security.* (file capabilities, SELinux labels), system.* (ACLs), and
// user.overlay.*, which overlayfs reads in place of trusted.overlay.* when
// mounted with userxattr.
func (u *unpacker) keptXattrs(hdr *tar.Header) [][2]string {
	var kept [][2]string
	for k, v := range hdr.PAXRecords {
		x, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok {
			continue
		}
		if strings.HasPrefix(x, "user.") && !strings.HasPrefix(x, "user.overlay.") {
			kept = append(kept, [2]string{x, v})
		} else {
			u.stats.dropped++
		}
	}
	slices.SortFunc(kept, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
	return kept
}

func countXattrs(hdr *tar.Header) int {
	n := 0
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "SCHILY.xattr.") {
			n++
		}
	}
	return n
}

func accessTime(hdr *tar.Header) time.Time {
	if hdr.AccessTime.IsZero() {
		return hdr.ModTime
	}
	return hdr.AccessTime
}

func timespecs(atime, mtime time.Time) []unix.Timespec {
	return []unix.Timespec{unix.NsecToTimespec(atime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
}

// setTimes sets an entry's times without following it.
func (u *unpacker) setTimes(parent int, base, name string, ts []unix.Timespec) error {
	if err := unix.UtimesNanoAt(parent, base, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, name, err)
	}
	return nil
}

// isSparse tells a GNU sparse entry, whose stream holds only the data
// fragments, from a plain one.
func isSparse(hdr *tar.Header) bool {
	if hdr.Typeflag == tar.TypeGNUSparse {
		return true
	}
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return true
		}
	}
	return false
}
