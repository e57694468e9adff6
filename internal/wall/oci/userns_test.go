package oci

import (
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// BenchmarkOwnedNamespaces is a runc create's namespaces: a holder forked
// into a new user and network namespace, its descriptors taken. ballast
// grows this process's heap to a daemon's (64 MiB written), which a
// fork of it copies the page tables of.
func BenchmarkOwnedNamespaces(b *testing.B) {
	testutil.RequireRoot(b)
	testutil.RequireKernelFeature(b, testutil.UserNamespaces)
	holder := filepath.Join(testutil.Binaries(b), "cage-agent")
	ballast := make([]byte, 64<<20)
	for i := range ballast {
		ballast[i] = byte(i)
	}
	b.ResetTimer()
	for range b.N {
		u, n, err := ownedNamespaces(1<<20+4090*65536, holder, true)
		if err != nil {
			b.Fatal(err)
		}
		unix.Close(u)
		unix.Close(n)
	}
	b.StopTimer()
	_ = ballast[len(ballast)-1]
}
