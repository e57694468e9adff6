package agent

import (
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"unicode/utf8"
	"unsafe"

	"golang.org/x/sys/unix"
)

// File metadata, as E2B's envd keeps it: an upload's `X-Metadata-<key>:
// <value>` headers become extended attributes `user.e2b.<key>` on the file
// (keys lowercased), and every EntryInfo (Stat, ListDir, Move, MakeDir,
// watch events) carries them back, prefix stripped. An upload replaces the
// file, so it replaces its metadata too: keys it does not send are gone.
// Keys and values are printable ASCII; a key is at most 246 bytes (the
// kernel's 255 less the prefix) and a file's whole set at most 4096 bytes,
// the prefix counted per key. Reading and writing them runs as the
// requesting user, like every file operation (user.* attributes need the
// user's read or write permission on the file), and only regular files and
// directories hold them.

const (
	metadataHeader   = "X-Metadata-"
	metadataPrefix   = "user.e2b."
	maxMetadataKey   = 255 - len(metadataPrefix)
	maxMetadataTotal = 4096
)

// errNoXattrs is a file system that cannot keep metadata (tmpfs before
// Linux 6.6, for one).
var errNoXattrs = errors.New("this file system cannot keep file metadata (user extended attributes)")

// metadataFromHeaders returns an upload's metadata: its X-Metadata-* headers
// with the prefix cut and the key lowercased, the first value of each.
// Malformed metadata is a 400.
func metadataFromHeaders(h http.Header) (map[string]string, *httpError) {
	var md map[string]string
	for name, values := range h {
		// Go's server canonicalizes names: "X-Metadata-Owner".
		key, ok := strings.CutPrefix(http.CanonicalHeaderKey(name), metadataHeader)
		if !ok || key == "" || len(values) == 0 {
			continue
		}
		if md == nil {
			md = map[string]string{}
		}
		md[strings.ToLower(key)] = values[0]
	}
	if err := validMetadata(md); err != nil {
		return nil, httpErr(http.StatusBadRequest, "invalid metadata: %v", err)
	}
	return md, nil
}

// validMetadata checks E2B's bounds.
func validMetadata(md map[string]string) error {
	total := 0
	for k, v := range md {
		switch {
		case k == "":
			return errors.New("a key is empty")
		case len(k) > maxMetadataKey:
			return fmt.Errorf("key %.32q... is longer than %d bytes", k, maxMetadataKey)
		case !printable(k):
			return fmt.Errorf("key %q is not printable ASCII", k)
		case !printable(v):
			return fmt.Errorf("the value of %q is not printable ASCII", k)
		}
		total += len(metadataPrefix) + len(k) + len(v)
	}
	if total > maxMetadataTotal {
		return fmt.Errorf("%d bytes of metadata (the prefix %q counted per key), more than %d", total, metadataPrefix, maxMetadataTotal)
	}
	return nil
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// writeMetadata sets md on the open file fd (a new file: it has none yet).
func writeMetadata(fd int, md map[string]string) error {
	for k, v := range md {
		err := unix.Fsetxattr(fd, metadataPrefix+k, []byte(v), 0)
		switch {
		case err == unix.ENOTSUP || err == unix.EOPNOTSUPP:
			return errNoXattrs
		case err == unix.E2BIG || err == unix.ERANGE:
			return unix.ENOSPC // more than this file system keeps per file
		case err != nil:
			return err
		}
	}
	return nil
}

// readMetadata returns the metadata of name in the directory dirfd (name ""
// is dirfd itself), not following name if it is a symlink; nil when it has
// none or the user may not read it. At most maxMetadataTotal bytes are read,
// whatever was set from inside the sandbox.
func readMetadata(dirfd int, name string, mode uint32) map[string]string {
	if t := mode & unix.S_IFMT; t != unix.S_IFREG && t != unix.S_IFDIR {
		return nil
	}
	x := xattrsAt{dirfd: dirfd, name: name}
	buf := make([]byte, 4096)
	n, err := x.list(buf)
	if err == unix.ERANGE {
		buf = make([]byte, 64<<10) // XATTR_LIST_MAX
		n, err = x.list(buf)
	}
	if err != nil || n <= 0 {
		return nil
	}
	var md map[string]string
	total := 0
	val := make([]byte, maxMetadataTotal)
	for _, attr := range strings.Split(string(buf[:n]), "\x00") {
		key, ok := strings.CutPrefix(attr, metadataPrefix)
		if !ok || key == "" || !utf8.ValidString(key) {
			continue
		}
		m, err := x.get(attr, val)
		if err != nil || !utf8.Valid(val[:m]) {
			continue // gone, unreadable, or larger than any set's budget
		}
		if total += len(attr) + m; total > maxMetadataTotal {
			break
		}
		if md == nil {
			md = map[string]string{}
		}
		md[key] = string(val[:m])
	}
	return md
}

// xattrsAt reads the extended attributes of one entry named under a
// directory descriptor, without following it: with listxattrat and
// getxattrat (Linux 6.13), else through the kernel's own link to the
// directory, /proc/self/fd/N/name (gVisor, older kernels; three times the
// cost on a listing).
type xattrsAt struct {
	dirfd int
	name  string
}

// xattrAtMissing is set once the kernel (or a seccomp filter) has refused
// the *xattrat calls.
var xattrAtMissing atomic.Bool

func (x xattrsAt) list(buf []byte) (int, error) {
	if !xattrAtMissing.Load() {
		n, err := x.at(unix.SYS_LISTXATTRAT, nil, buf)
		if err != unix.ENOSYS && err != unix.EPERM {
			return n, err
		}
		xattrAtMissing.Store(true)
	}
	if x.name == "" {
		return unix.Listxattr(x.procPath(), buf) // follows the fd's link itself
	}
	return unix.Llistxattr(x.procPath(), buf)
}

func (x xattrsAt) get(attr string, buf []byte) (int, error) {
	if !xattrAtMissing.Load() {
		n, err := x.at(unix.SYS_GETXATTRAT, &attr, buf)
		if err != unix.ENOSYS && err != unix.EPERM {
			return n, err
		}
		xattrAtMissing.Store(true)
	}
	if x.name == "" {
		return unix.Getxattr(x.procPath(), attr, buf)
	}
	return unix.Lgetxattr(x.procPath(), attr, buf)
}

func (x xattrsAt) procPath() string {
	p := "/proc/self/fd/" + strconv.Itoa(x.dirfd)
	if x.name != "" {
		p += "/" + x.name
	}
	return p
}

// xattrArgs is the kernel's struct xattr_args.
type xattrArgs struct {
	value uint64
	size  uint32
	flags uint32
}

// at calls listxattrat (attr nil) or getxattrat on the entry.
func (x xattrsAt) at(nr uintptr, attr *string, buf []byte) (int, error) {
	path, err := unix.BytePtrFromString(x.name)
	if err != nil {
		return 0, err
	}
	flags := uintptr(unix.AT_SYMLINK_NOFOLLOW)
	if x.name == "" {
		flags |= unix.AT_EMPTY_PATH
	}
	var bufp unsafe.Pointer
	if len(buf) > 0 {
		bufp = unsafe.Pointer(&buf[0])
	}
	var n uintptr
	var errno unix.Errno
	if attr == nil {
		n, _, errno = unix.Syscall6(nr, uintptr(x.dirfd), uintptr(unsafe.Pointer(path)), flags,
			uintptr(bufp), uintptr(len(buf)), 0)
	} else {
		name, err := unix.BytePtrFromString(*attr)
		if err != nil {
			return 0, err
		}
		args := xattrArgs{value: uint64(uintptr(bufp)), size: uint32(len(buf))}
		n, _, errno = unix.Syscall6(nr, uintptr(x.dirfd), uintptr(unsafe.Pointer(path)), flags,
			uintptr(unsafe.Pointer(name)), uintptr(unsafe.Pointer(&args)), unsafe.Sizeof(args))
	}
	runtime.KeepAlive(buf)
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}
