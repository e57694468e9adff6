package network

import (
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// TestNFTClosedTouchesNoReusedNumber: once the table's connection is
// closed, its namespace descriptor's number may be another file's; what
// still comes to the table (a sandbox's removal, a name learnt) fails as
// closed, and neither it nor a second close acts on that number. Before,
// the closed connection dialled again, joining the namespace by the
// number (setns on whatever had taken it: another namespace, or a file
// setns refuses, which ended the locked thread and any child whose
// parent-death signal it carried), and a second close closed the number.
// Here a pipe takes the number after the close.
func TestNFTClosedTouchesNoReusedNumber(t *testing.T) {
	testutil.RequireRoot(t)
	n, err := newNFT()
	if err != nil {
		t.Skipf("nftables: %v", err)
	}
	number := n.netns
	n.close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if err := unix.Dup3(int(w.Fd()), number, unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(number)

	// The library keeps the error's words, not always the error.
	closed := func(err error) bool { return err != nil && strings.Contains(err.Error(), errNFTClosed.Error()) }
	if _, err := n.slots(); !closed(err) {
		t.Errorf("a listing after the close said %v, not that the table is closed", err)
	}
	if err := n.remove(3); !closed(err) {
		t.Errorf("a removal after the close said %v, not that the table is closed", err)
	}
	n.close()
	if _, err := unix.FcntlInt(uintptr(number), unix.F_GETFD, 0); err != nil {
		t.Fatalf("the file that took the closed namespace's number was closed: %v", err)
	}
}
