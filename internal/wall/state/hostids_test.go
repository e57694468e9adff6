package state

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestHostUsersIDsNeverReserved: a slot whose host ids a host user holds
// (a delegation in /etc/subuid or /etc/subgid, which newuidmap lets the
// user become without privilege, or an account's own id) is never a
// sandbox's. Such a user could otherwise signal the sandbox's processes
// and, as the sandbox's root gid, traverse its state directory into its
// files: found by review, 2026-12-03, a user with a delegation over a runc
// sandbox's range planted /tmp/planted in it through
// RUN/sandboxes/ID/rootfs, and stopped its commands with kill -STOP. The
// root account's delegations (LXD's, Incus's) are the host's own.
func TestHostUsersIDsNeverReserved(t *testing.T) {
	oldLocks, oldFiles := IDLockDir, hostIDFiles
	dir := t.TempDir()
	IDLockDir = filepath.Join(dir, "ids")
	hostIDFiles.subuid = filepath.Join(dir, "subuid")
	hostIDFiles.subgid = filepath.Join(dir, "subgid")
	hostIDFiles.passwd = filepath.Join(dir, "passwd")
	hostIDFiles.group = filepath.Join(dir, "group")
	defer func() { IDLockDir, hostIDFiles = oldLocks, oldFiles }()

	base := func(n int) int { return idBase + n*idRangeSize }
	write := func(path string, lines ...string) {
		if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Every slot but 5 and 9 holds some host user's ids.
	write(hostIDFiles.subuid,
		"# delegations",
		fmt.Sprintf("root:%d:%d", idBase, idSlots*idRangeSize),   // the host's own: not counted
		fmt.Sprintf("alice:%d:%d", base(0)-30000, 5*idRangeSize), // slots 0-4, the last in part
		fmt.Sprintf("carol:%d:%d", base(12), (idSlots-12)*idRangeSize))
	write(hostIDFiles.subgid, fmt.Sprintf("1001:%d:%d", base(6), 3*idRangeSize)) // slots 6-8
	write(hostIDFiles.passwd, "root:x:0:0:root:/root:/bin/bash",
		fmt.Sprintf("svc:x:%d:100::/:/bin/sh", base(10)+7))
	write(hostIDFiles.group, "root:x:0:", fmt.Sprintf("svcgrp:x:%d:", base(11)+65535))

	got := map[int]bool{}
	var held []*IDRange
	for i := 0; i < 2; i++ {
		r, err := ReserveIDs()
		if err != nil {
			t.Fatalf("reservation %d: %v", i, err)
		}
		held = append(held, r)
		t.Cleanup(r.Release)
		got[r.Slot()] = true
	}
	if !got[5] || !got[9] {
		t.Fatalf("reserved slots %v, want 5 and 9 (the only ones no host user holds ids of)", got)
	}
	if r, err := ReserveIDs(); err == nil {
		t.Fatalf("reserved slot %d, which holds a host user's ids", r.Slot())
	} else if !strings.Contains(err.Error(), "host's users") {
		t.Errorf("error %q does not say why", err)
	}
	for _, r := range held {
		r.Release()
	}
	for _, n := range []int{0, 4, 6, 10, 11, 4095} {
		if r, err := ReserveSlot(n); err == nil {
			r.Release()
			t.Errorf("ReserveSlot(%d): reserved, though a host user holds its ids", n)
		}
	}
	r, err := ReserveSlot(9)
	if err != nil {
		t.Fatalf("ReserveSlot(9): %v", err)
	}
	r.Release()

	// A delegation that goes away (the user removed) frees its slots;
	// one added is seen at the next reservation.
	write(hostIDFiles.subuid, fmt.Sprintf("carol:%d:%d", base(1), (idSlots-1)*idRangeSize))
	write(hostIDFiles.subgid)
	write(hostIDFiles.passwd)
	write(hostIDFiles.group)
	for i := 0; i < 2; i++ {
		r, err := ReserveIDs()
		if i == 0 {
			if err != nil || r.Slot() != 0 {
				t.Fatalf("after the files changed: %v, %v; want slot 0", r, err)
			}
			defer r.Release()
		} else if err == nil {
			t.Fatalf("reserved slot %d, which carol now holds", r.Slot())
		}
	}
}
