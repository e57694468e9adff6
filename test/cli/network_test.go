package clitest

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/testutil"
)

func TestMain(m *testing.M) { os.Exit(testutil.InOwnNetwork(m)) }

// TestRunNetwork: `cage run --net` and `--allow` give the command what they
// say, with the test world as the outside (CAGE_DNS points cage's resolver
// at it), and leave no interface or rule behind.
func TestRunNetwork(t *testing.T) {
	e := setup(t)
	w := testutil.SharedWorld(t)
	dns := "CAGE_DNS=" + strings.Join(w.Upstreams(), ",")
	get := `import urllib.request, sys
for u in sys.argv[1:]:
    try: print(u, "OK", urllib.request.urlopen(u, timeout=5).read().decode())
    except Exception as ex: print(u, "FAIL", type(ex).__name__)`
	urls := []string{"http://other.example.org/", "http://allowed.example.com/", "http://169.254.169.254/", "http://" + testutil.OtherHost.String() + "/"}
	for _, tc := range []struct {
		args []string
		want []string // per url: OK or FAIL
	}{
		{nil, []string{"FAIL", "FAIL", "FAIL", "FAIL"}},
		{[]string{"--net", "internet"}, []string{"OK", "OK", "FAIL", "OK"}},
		{[]string{"--allow", "allowed.example.com"}, []string{"FAIL", "OK", "FAIL", "FAIL"}},
		{[]string{"--net", "internet", "--deny", testutil.OtherHost.String()}, []string{"FAIL", "OK", "FAIL", "FAIL"}},
	} {
		args := append([]string{"run"}, tc.args...)
		args = append(args, "--", "python3", "-c", get)
		args = append(args, urls...)
		r := e.cageEnv(nil, []string{dns}, args...)
		if r.code != 0 {
			t.Errorf("cage %v: %v", tc.args, r)
			continue
		}
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		for i, u := range urls {
			if i >= len(lines) || strings.Fields(lines[i])[1] != tc.want[i] {
				t.Errorf("cage run %v: %s: got %q, want %s", tc.args, u, lines, tc.want[i])
			}
		}
		e.noLeftovers(r.ids...)
	}
	if links := network.HostLinks(); len(links) != 0 {
		t.Errorf("interfaces left after cage run: %v", links)
	}
	if slots, _ := network.TableSlots(); len(slots) != 0 {
		t.Errorf("rules left after cage run: slots %v", slots)
	}
}

// TestNetworkLeftoversCollected: an interface a dead cage process left
// behind (a networked sandbox's host end, here made by hand) is removed by
// the next cage run, even one without a network.
func TestNetworkLeftoversCollected(t *testing.T) {
	e := setup(t)
	w := testutil.SharedWorld(t)
	if out, err := exec.Command("ip", "link", "add", "cage4000", "type", "veth", "peer", "name", "leftpeer4000").CombinedOutput(); err != nil {
		t.Fatalf("make a leftover veth: %v: %s", err, out)
	}
	defer exec.Command("ip", "link", "del", "cage4000").Run()
	r := e.cageEnv(nil, []string{"CAGE_DNS=" + strings.Join(w.Upstreams(), ",")}, "run", "--", "true")
	if r.code != 0 {
		t.Fatalf("cage run: %v", r)
	}
	if err := exec.Command("ip", "link", "show", "cage4000").Run(); err == nil {
		t.Error("the leftover interface cage4000 is still there after a cage run")
	}
}
