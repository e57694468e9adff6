package store

import (
	"fmt"
	"testing"
)

// BenchmarkSandboxRow is what the daemon's store does for each create: the
// row inserted, updated once the sandbox runs, read back.
func BenchmarkSandboxRow(b *testing.B) {
	s, err := Open(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	i := 0
	for b.Loop() {
		sb := sample(fmt.Sprintf("sb%08d", i))
		i++
		if err := s.InsertSandbox(sb); err != nil {
			b.Fatal(err)
		}
		if err := s.UpdateSandbox(sb); err != nil {
			b.Fatal(err)
		}
		if _, err := s.GetSandbox(sb.ID); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkVerifyKey is the check of every API request's key.
func BenchmarkVerifyKey(b *testing.B) {
	s, err := Open(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	plain, _, err := s.CreateKey("bench")
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := s.VerifyKey(plain); err != nil {
			b.Fatal(err)
		}
	}
}
