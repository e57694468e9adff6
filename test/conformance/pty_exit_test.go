package conformance

import (
	"strings"
	"testing"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/sandbox"
)

// TestPTYProgramThatClosesStdoutExits: coreutils programs close stdout
// before they exit; the terminal must not be hung up in that moment (the
// agent used to close the PTY master as soon as it read EIO, and such a
// program died of SIGHUP about one run in seven). Expected: exit 0 every time.
func TestPTYProgramThatClosesStdoutExits(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})
		for i := 0; i < 25; i++ {
			r := b.run(func(o *agentclient.RunOptions) {
				o.Cmd, o.Args = "head", []string{"-1"}
				o.PTY = &pb.PTY_Size{Cols: 80, Rows: 24}
				o.Stdin = strings.NewReader("line\n")
			})
			if r.err != nil || r.code() != 0 || !r.end.GetExited() {
				t.Fatalf("run %d: head -1 in a PTY: %+v %v", i, r.end, r.err)
			}
		}
	})
}
