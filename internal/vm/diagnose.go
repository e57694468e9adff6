package vm

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
)

// What QEMU says of the VM's devices and of its translations, for reports
// and traces: nothing cage decides on.

// virtioQueue is one queue's state as x-query-virtio-queue-status gives
// it: the guest offered buffers up to ShadowAvail (as QEMU last read it),
// QEMU took them up to LastAvail, holds InUse of them, gave them back up
// to Used and last told the guest so at SignalledUsed.
type virtioQueue struct {
	Index         int    `json:"queue-index"`
	ShadowAvail   uint16 `json:"shadow-avail-idx"`
	LastAvail     uint16 `json:"last-avail-idx"`
	Used          uint16 `json:"used-idx"`
	SignalledUsed uint16 `json:"signalled-used"`
	SignalledOK   bool   `json:"signalled-used-valid"`
	InUse         int    `json:"inuse"`
}

// VirtioQueues describes every queue of the VM's virtio devices, one line
// per device: "virtio-serial: q0 avail 12 taken 12 used 12 signalled 12
// inuse 0; q1 ...". For a report when the guest stops answering: a queue
// whose buffers QEMU gave back (used) without telling the guest
// (signalled behind), or that the guest filled and QEMU did not take,
// says which side waits.
func (v *VM) VirtioQueues(ctx context.Context) (string, error) {
	q, err := v.qmp(ctx)
	if err != nil {
		return "", err
	}
	defer q.Close()
	r, err := q.call(ctx, "x-query-virtio", nil)
	if err != nil {
		return "", err
	}
	var devs []struct {
		Name string `json:"name"`
		Path string `json:"path"`
	}
	if err := json.Unmarshal(r, &devs); err != nil {
		return "", fmt.Errorf("x-query-virtio: %w", err)
	}
	var lines []string
	for _, d := range devs {
		var qs []string
		// A device's queues are numbered from 0; the first index QEMU
		// refuses is the end (a virtio-serial of 2 ports has 6).
		for i := 0; i < 64; i++ {
			r, err := q.call(ctx, "x-query-virtio-queue-status", map[string]any{"path": d.Path, "queue": i})
			if err != nil {
				if _, refused := err.(*qmpError); refused {
					break
				}
				return "", err
			}
			var s virtioQueue
			if err := json.Unmarshal(r, &s); err != nil {
				return "", fmt.Errorf("x-query-virtio-queue-status: %w", err)
			}
			signalled := "?"
			if s.SignalledOK {
				signalled = strconv.Itoa(int(s.SignalledUsed))
			}
			qs = append(qs, fmt.Sprintf("q%d avail %d taken %d used %d signalled %s inuse %d", s.Index, s.ShadowAvail, s.LastAvail, s.Used, signalled, s.InUse))
		}
		lines = append(lines, d.Name+": "+strings.Join(qs, "; "))
	}
	return strings.Join(lines, "\n"), nil
}

// TranslatedBlocks is how many blocks of guest code TCG has translated in
// this QEMU (`info jit`'s TB count; 0 under KVM): under TCG each costs the
// first run of its code, so counts taken along a create say where a
// restored guest's time goes (a trace's figure).
func (v *VM) TranslatedBlocks(ctx context.Context) (int, error) {
	q, err := v.qmp(ctx)
	if err != nil {
		return 0, err
	}
	defer q.Close()
	r, err := q.call(ctx, "human-monitor-command", map[string]string{"command-line": "info jit"})
	if err != nil {
		return 0, err
	}
	var s string
	if err := json.Unmarshal(r, &s); err != nil {
		return 0, fmt.Errorf("info jit: %w", err)
	}
	return tbCount(s)
}

var tbCountLine = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`(?m)^TB count\s+(\d+)`) })

// tbCount reads the TB count from `info jit`'s text.
func tbCount(info string) (int, error) {
	if strings.Contains(info, "only available with accel=tcg") {
		return 0, nil // KVM: nothing is translated
	}
	m := tbCountLine().FindStringSubmatch(info)
	if m == nil {
		return 0, fmt.Errorf("info jit: no TB count in %q", firstLine(info))
	}
	return strconv.Atoi(m[1])
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return s
}
