package state

import (
	"fmt"
	"os"
	"syscall"
)

// FileID names a file's content as it is now: its device, inode, size and
// modification time (a binary installed anew changes at least one). The
// walls' pools compare it to tell a member made with an agent or runtime
// binary that has since been replaced.
func FileID(p string) (string, error) {
	fi, err := os.Stat(p)
	if err != nil {
		return "", err
	}
	st := fi.Sys().(*syscall.Stat_t)
	return fmt.Sprintf("%d-%d-%d-%d", st.Dev, st.Ino, fi.Size(), fi.ModTime().UnixNano()), nil
}
