package vm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"
)

// probeTimeout bounds ProbeKVM's boot. A guest under KVM says hello in well
// under a second; one under a hypervisor that cannot run it hangs, so the
// wait must end on its own.
const probeTimeout = 10 * time.Second

// ProbeKVM says whether KVM runs a guest here: it boots initramfs (whose
// /init must write a line to the agent port once it is up) with k under
// accel=kvm and waits up to 10 s for that line. A /dev/kvm that opens is not
// enough: a nested hypervisor may offer one that runs no stock kernel.
// When KVM is not usable, reason says why in one line.
func ProbeKVM(ctx context.Context, k *Kernel, initramfs string) (ok bool, reason string) {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if errors.Is(err, os.ErrNotExist) {
		return false, "no /dev/kvm"
	}
	if err != nil {
		return false, err.Error()
	}
	f.Close()

	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	dir, err := os.MkdirTemp("", "cage-kvm-probe")
	if err != nil {
		return false, err.Error()
	}
	defer os.RemoveAll(dir)
	v, err := Start(ctx, Config{Kernel: k, Initramfs: initramfs, Accel: "kvm", MemoryMB: 128, Dir: dir})
	if err != nil {
		return false, err.Error()
	}
	defer v.Stop()
	conn, err := v.DialAgent(ctx)
	if err != nil {
		return false, probeFailure(ctx, v, err)
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		conn.SetReadDeadline(dl)
	}
	if _, err := bufio.NewReader(conn).ReadString('\n'); err != nil {
		return false, probeFailure(ctx, v, err)
	}
	return true, ""
}

// probeFailure describes why the probe's guest did not say hello.
func probeFailure(ctx context.Context, v *VM, err error) string {
	// QEMU closes the socket as it exits; give the reaping a moment so the
	// reason can be QEMU's own words.
	select {
	case <-v.done:
		return v.exitReason()
	case <-time.After(200 * time.Millisecond):
	}
	if ctx.Err() != nil {
		msg := fmt.Sprintf("the guest did not come up within %s under KVM", probeTimeout)
		if line := v.ConsoleLastLine(); line != "" {
			msg += "; its console's last line: " + line
		}
		if line := v.stderr.lastLine(); line != "" {
			msg += "; qemu said: " + strings.TrimPrefix(line, QEMU+": ")
		}
		return msg
	}
	return "agent port: " + err.Error()
}
