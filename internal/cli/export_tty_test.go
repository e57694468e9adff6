package cli

import (
	"bytes"
	"os"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// openPTY opens a pseudo-terminal's two ends.
func openPTY(t *testing.T) (ptm, pts *os.File) {
	t.Helper()
	ptm, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pseudo-terminals here: %v", err)
	}
	t.Cleanup(func() { ptm.Close() })
	if err := unix.IoctlSetPointerInt(int(ptm.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(ptm.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	pts, err = os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pts.Close() })
	return ptm, pts
}

// TestTemplateExportNotToATerminal: `cage template export NAME` with no
// -o writes to standard output; when that is the operator's terminal it is
// refused (exit 64, one line) before a byte is written: the tarball holds
// the image's files, bytes its author chose, which a terminal reads as
// escape sequences (its clipboard, its title, answers typed back).
func TestTemplateExportNotToATerminal(t *testing.T) {
	_, pts := openPTY(t)
	t.Setenv("CAGE_TEMPLATES", t.TempDir())
	var stderr bytes.Buffer
	code := Main([]string{"template", "export", "base"}, pts, &stderr)
	if code != ExitUsage || !strings.Contains(stderr.String(), "standard output is a terminal") {
		t.Fatalf("export to a terminal: exit %d, %q; want %d and the refusal", code, stderr.String(), ExitUsage)
	}
}
