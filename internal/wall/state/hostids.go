package state

import (
	"bufio"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// Host ids that are someone's already: a sandbox's range must hold none.
//
// A user to whom /etc/subuid or /etc/subgid delegates ids can become any of
// them without privilege (newuidmap, newgidmap: `unshare --map-users`), and
// an account of /etc/passwd or /etc/group is its ids. Had a sandbox the same
// host ids, that user would be its root or its user as far as the host's
// kernel is concerned: signal its processes (kill compares ids, not user
// namespaces), and traverse its state directory (group: the sandbox's root)
// into its disk and root file system, to read and plant files. Found by
// review, 2026-12-03: shadow's useradd delegates 65536 ids to each new user
// from 100000 up, so the 15th user on a host and every later one holds a
// range inside cage's (from 2^20).
//
// The root account's own delegations are the host's (LXD and Incus give
// root 1000000:1000000000, which holds every slot): those are not counted.
var hostIDFiles = struct{ subuid, subgid, passwd, group string }{
	"/etc/subuid", "/etc/subgid", "/etc/passwd", "/etc/group",
}

// idSpan is the host ids [lo, hi).
type idSpan struct{ lo, hi uint64 }

// takenIDs caches the spans read from hostIDFiles, read again when one of
// them changes.
var takenIDs struct {
	sync.Mutex
	key   string
	spans []idSpan
}

// slotTaken reports whether slot n's range holds ids that are a host
// user's (see hostIDFiles).
func slotTaken(n int) bool {
	lo := uint64(idBase + n*idRangeSize)
	hi := lo + idRangeSize
	for _, s := range hostSpans() {
		if s.lo < hi && lo < s.hi {
			return true
		}
	}
	return false
}

func hostSpans() []idSpan {
	files := []string{hostIDFiles.subuid, hostIDFiles.subgid, hostIDFiles.passwd, hostIDFiles.group}
	var key strings.Builder
	for _, f := range files {
		var st syscall.Stat_t
		if syscall.Stat(f, &st) == nil {
			key.WriteString(strconv.FormatUint(st.Dev, 10) + ":" + strconv.FormatUint(st.Ino, 10) + ":" +
				strconv.FormatInt(st.Size, 10) + ":" + strconv.FormatInt(st.Mtim.Nano(), 10) + "/")
		} else {
			key.WriteString("-/")
		}
	}
	takenIDs.Lock()
	defer takenIDs.Unlock()
	if k := key.String(); k != takenIDs.key || takenIDs.spans == nil {
		var spans []idSpan
		spans = append(spans, readSubIDs(hostIDFiles.subuid)...)
		spans = append(spans, readSubIDs(hostIDFiles.subgid)...)
		spans = append(spans, readAccountIDs(hostIDFiles.passwd)...)
		spans = append(spans, readAccountIDs(hostIDFiles.group)...)
		takenIDs.key, takenIDs.spans = k, append(spans, idSpan{}) // never nil once read
	}
	return takenIDs.spans
}

// readSubIDs reads a subordinate id file: "owner:first:count" a line, the
// owner a name or a uid. root's lines are left out (see hostIDFiles).
func readSubIDs(path string) []idSpan {
	var spans []idSpan
	eachLine(path, func(line string) {
		f := strings.Split(line, ":")
		if len(f) != 3 || f[0] == "root" || f[0] == "0" {
			return
		}
		first, err1 := strconv.ParseUint(f[1], 10, 32)
		count, err2 := strconv.ParseUint(f[2], 10, 32)
		if err1 == nil && err2 == nil && count > 0 {
			spans = append(spans, idSpan{first, first + count})
		}
	})
	return spans
}

// readAccountIDs reads the ids of /etc/passwd or /etc/group (the third
// field of each line) that fall in cage's ranges.
func readAccountIDs(path string) []idSpan {
	var spans []idSpan
	eachLine(path, func(line string) {
		f := strings.SplitN(line, ":", 4)
		if len(f) < 3 {
			return
		}
		id, err := strconv.ParseUint(f[2], 10, 32)
		if err == nil && id >= idBase && id < idBase+idSlots*idRangeSize {
			spans = append(spans, idSpan{id, id + 1})
		}
	})
	return spans
}

// eachLine calls fn with each line of path that is neither empty nor a
// comment; a file that cannot be read has none. At most 64 MiB is read.
func eachLine(path string, fn func(string)) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	sc := bufio.NewScanner(io.LimitReader(f, 64<<20))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line != "" && !strings.HasPrefix(line, "#") {
			fn(line)
		}
	}
}
