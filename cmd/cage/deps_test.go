package main

import (
	"os/exec"
	"strings"
	"testing"
)

// startCost are packages the cage binary must not link: every cage
// process, `cage run` included, would pay their package initialisation and
// the heap it allocates (each measured at 0.5-1 ms of CPU and about 100
// page faults on a nested VM) for what only the daemon uses, and cage has
// its own narrow code for that instead.
var startCost = map[string]string{
	"github.com/prometheus/client_golang": "internal/metrics writes Prometheus's text format itself",
	"github.com/prometheus/procfs":        "internal/metrics reads /proc/self itself",
	"k8s.io/client-go":                    "internal/kube is cluster mode's client",
}

func TestStartCostDependencies(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("SKIP: needs the go command to list cage's packages")
	}
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	pkgs := strings.Fields(string(out))
	if len(pkgs) < 50 {
		t.Fatalf("go list found %d packages: %v", len(pkgs), pkgs)
	}
	for _, p := range pkgs {
		for prefix, instead := range startCost {
			if p == prefix || strings.HasPrefix(p, prefix+"/") {
				t.Errorf("cage links %s (%s)", p, instead)
			}
		}
	}
}
