package agent

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// The sandbox's account files (/etc/passwd, /etc/group) are the sandbox's
// own: root inside may rewrite them, or swap in a FIFO, a symlink or a huge
// file. The agent reads them with O_NONBLOCK|O_NOFOLLOW, only when they are
// regular files of at most maxAccountsFile bytes, and keeps each parsed copy
// until a stat shows the file changed (device, inode, size, mtime, ctime).
// A lookup then costs one stat rather than a read, which matters when a
// workload holds every other pid of the sandbox.

// maxAccountsFile bounds the bytes read from one account file.
const maxAccountsFile = 4 << 20

// maxID is the largest uid or gid accepted: (uid_t)-1 means "unchanged" to
// the kernel's set*id calls, so it can never name a user.
const maxID = 1<<32 - 2

// User is an account inside the sandbox, read from the sandbox's /etc/passwd.
type User struct {
	Name string
	UID  int
	GID  int
	Home string
}

// accounts is one parsed account file.
type accounts struct {
	key    fileKey
	users  map[string]passwdEntry // passwd lines by name; the first line wins
	names  map[uint32]string      // name by id (field 3); the first line wins
	groups map[string]groupEntry  // group lines (four fields) by name; the first wins
}

type groupEntry struct {
	gid     uint32
	gidOK   bool
	members []string
}

type passwdEntry struct {
	u   User
	bad bool // an id is not a number in range
}

// fileKey tells one version of a file from another.
type fileKey struct {
	dev, ino     uint64
	size         int64
	mtime, ctime unix.Timespec
}

func keyOf(st *unix.Stat_t) fileKey {
	return fileKey{dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim, ctime: st.Ctim}
}

var accountCache struct {
	sync.Mutex
	m map[string]*accounts
}

// loadAccounts returns the parsed account file at path, read again only
// when it changed since the last call.
func loadAccounts(path string) (*accounts, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(unix.AT_FDCWD, path, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	key := keyOf(&st)
	accountCache.Lock()
	a := accountCache.m[path]
	accountCache.Unlock()
	if a != nil && a.key == key {
		return a, nil
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	a, err := readAccountsFile(path)
	if err != nil {
		return nil, err
	}
	accountCache.Lock()
	if accountCache.m == nil {
		accountCache.m = map[string]*accounts{}
	}
	accountCache.m[path] = a
	accountCache.Unlock()
	return a, nil
}

// readAccountsFile reads and parses path, refusing anything but a regular
// file of bounded size. O_NONBLOCK keeps a FIFO swapped in after the stat
// from blocking the open.
func readAccountsFile(path string) (*accounts, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOFOLLOW|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	if st.Size > maxAccountsFile {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, maxAccountsFile)
	}
	data, err := io.ReadAll(io.LimitReader(f, maxAccountsFile+1))
	if err != nil {
		return nil, &os.PathError{Op: "read", Path: path, Err: err}
	}
	if len(data) > maxAccountsFile {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, maxAccountsFile)
	}
	a := parseAccounts(data)
	a.key = keyOf(&st)
	return a, nil
}

// parseAccounts parses an /etc/passwd- or /etc/group-shaped file. Lines
// without a name or with an id that is not a number in [0, maxID] name
// nobody; passwd entries need the seven fields of passwd(5).
func parseAccounts(data []byte) *accounts {
	a := &accounts{users: map[string]passwdEntry{}, names: map[uint32]string{}, groups: map[string]groupEntry{}}
	for len(data) > 0 {
		line := data
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			line, data = data[:i], data[i+1:]
		} else {
			data = nil
		}
		fields := strings.SplitN(string(line), ":", 8)
		if len(fields) < 3 || fields[0] == "" {
			continue
		}
		name := fields[0]
		id, idOK := parseID(fields[2])
		if _, dup := a.names[id]; idOK && !dup {
			a.names[id] = name
		}
		if _, dup := a.groups[name]; len(fields) == 4 && !dup {
			var members []string
			for _, m := range strings.Split(fields[3], ",") {
				if m = strings.TrimSpace(m); m != "" {
					members = append(members, m)
				}
			}
			a.groups[name] = groupEntry{gid: id, gidOK: idOK, members: members}
		}
		if _, dup := a.users[name]; len(fields) < 7 || dup {
			continue
		}
		gid, gidOK := parseID(fields[3])
		a.users[name] = passwdEntry{
			u:   User{Name: name, UID: int(id), GID: int(gid), Home: fields[5]},
			bad: !idOK || !gidOK,
		}
	}
	return a
}

// parseID parses a decimal uid or gid in [0, maxID].
func parseID(s string) (uint32, bool) {
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil || n > maxID {
		return 0, false
	}
	return uint32(n), true
}

// lookup finds name among a's passwd entries, or as a bare id.
func (a *accounts) lookup(name string) (User, error) {
	if name == "" {
		return User{}, errors.New("empty user name")
	}
	if a != nil {
		if e, ok := a.users[name]; ok {
			if e.bad {
				return User{}, fmt.Errorf("user %q: malformed passwd entry", name)
			}
			return e.u, nil
		}
	}
	if n, ok := parseID(name); ok {
		return User{Name: name, UID: int(n), GID: int(n), Home: "/"}, nil
	}
	return User{}, fmt.Errorf("user %q does not exist in the sandbox", name)
}

// member reports whether user (whose primary group is gid) belongs to
// group, by a's group lines.
func (a *accounts) member(group, user string, gid uint32) bool {
	if a == nil {
		return false
	}
	g, ok := a.groups[group]
	if !ok {
		return false
	}
	if g.gidOK && g.gid == gid {
		return true
	}
	for _, m := range g.members {
		if m == user {
			return true
		}
	}
	return false
}

// name returns the name of id in a, or the number itself.
func (a *accounts) name(id uint32) string {
	if a != nil {
		if n, ok := a.names[id]; ok {
			return n
		}
	}
	return strconv.FormatUint(uint64(id), 10)
}

// LookupUser finds name in passwd (the sandbox's /etc/passwd). A numeric name
// that is not listed is accepted as a bare uid with gid = uid and home "/".
// An account file the agent refuses to read (not a regular file, too large)
// leaves only numeric names.
func LookupUser(passwd, name string) (User, error) {
	a, err := loadAccounts(passwd)
	u, lerr := a.lookup(name)
	if lerr != nil && err != nil && !errors.Is(err, unix.ENOENT) {
		return User{}, fmt.Errorf("%v (cannot read the sandbox's accounts: %v)", lerr, err)
	}
	return u, lerr
}

// lookupName returns the name for id in an /etc/passwd- or /etc/group-shaped
// file, or the number itself when it is not listed.
func lookupName(file string, id uint32) string {
	a, _ := loadAccounts(file)
	return a.name(id)
}
