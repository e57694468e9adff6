package main

import (
	"os/exec"
	"strings"
	"testing"
)

// insideOK are the packages (by import path prefix) cage-agent may link:
// what runs inside a sandbox, and the libraries they need. The host's
// halves of the walls, the template store and its registry client,
// nftables and the DNS server, the QEMU launcher, SQLite and the API must
// never enter the binary that runs in every sandbox: a package outside this
// list fails the test, named with the chain that pulled it in.
var insideOK = []string{
	"github.com/cagehq/cage/cmd/cage-agent",
	"github.com/cagehq/cage/api/gen/",
	"github.com/cagehq/cage/internal/agent",
	"github.com/cagehq/cage/internal/cgroups",
	"github.com/cagehq/cage/internal/filesig",
	"github.com/cagehq/cage/internal/inside",
	"github.com/cagehq/cage/internal/partbound",
	"github.com/cagehq/cage/internal/seal",
	"github.com/cagehq/cage/internal/seccomp",
	"github.com/cagehq/cage/internal/spawner", // on the host: forks agents (cgroups and x/sys only)
	"github.com/cagehq/cage/internal/trace",
	"github.com/cagehq/cage/internal/vm/boot",
	"github.com/cagehq/cage/internal/vm/jail",
	"github.com/cagehq/cage/internal/wall/channel",
	"github.com/cagehq/cage/internal/wall/microvm/guest",
	"github.com/cagehq/cage/internal/wall/oci/container",
	"github.com/cagehq/cage/internal/wall/process/child",
	"connectrpc.com/connect",
	"google.golang.org/protobuf/",
	"golang.org/x/sys/",
	"github.com/creack/pty",
	"github.com/hashicorp/yamux",
	"github.com/vishvananda/netlink", // the microvm guest configures its NIC
	"github.com/vishvananda/netns",
}

func TestAgentDependencies(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("SKIP: needs the go command to list cage-agent's packages")
	}
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}} {{join .Imports \",\"}}{{end}}", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	importers := map[string][]string{} // package -> packages that import it
	var pkgs []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		pkg, imports, _ := strings.Cut(line, " ")
		pkgs = append(pkgs, pkg)
		for _, imp := range strings.Split(imports, ",") {
			importers[imp] = append(importers[imp], pkg)
		}
	}
	if len(pkgs) < 10 {
		t.Fatalf("go list found %d packages: %v", len(pkgs), pkgs)
	}
	for _, pkg := range pkgs {
		if !allowed(pkg) {
			t.Errorf("cage-agent links %s (imported by %v): a package of the host's, or a library nobody vetted for the inside", pkg, importers[pkg])
		}
	}
	t.Logf("cage-agent links %d packages outside the standard library", len(pkgs))
}

func allowed(pkg string) bool {
	for _, p := range insideOK {
		if pkg == p || strings.HasPrefix(pkg, p) && (strings.HasSuffix(p, "/") || strings.HasPrefix(pkg, p+"/")) {
			return true
		}
	}
	return false
}
