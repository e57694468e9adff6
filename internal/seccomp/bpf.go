//go:build linux

package seccomp

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// This file is a small assembler for classic BPF with symbolic labels.
//
// Classic BPF only jumps forward. A conditional jump encodes its two targets
// as 8-bit offsets (at most 255 instructions ahead); the unconditional BPF_JA
// takes a 32-bit offset. The assembler resolves labels and relaxes every
// conditional jump whose target is too far: the short offset then points at
// a BPF_JA trampoline emitted right after the jump, which reaches the real
// target. Relaxation repeats until no offset changes, since growing one jump
// can push another out of range.

// maxInsns is the kernel's limit on the length of a classic BPF program
// (BPF_MAXINSNS).
const maxInsns = 4096

// A label names the instruction that follows the point where it is bound.
type label string

// next is the target of a conditional jump that falls through to the
// following instruction.
const next label = ""

type insnKind int

const (
	kindPlain insnKind = iota // no jump
	kindCond                  // conditional jump with jt/jf labels
	kindJA                    // unconditional jump to target
)

type insn struct {
	kind   insnKind
	code   uint16
	k      uint32
	jt, jf label // kindCond
	target label // kindJA
}

// asm collects instructions and labels. The first error sticks and is
// returned by assemble.
type asm struct {
	insns  []insn
	labels map[label]int // label -> index of the instruction it names
	err    error
}

func newAsm() *asm { return &asm{labels: make(map[label]int)} }

func (a *asm) fail(format string, args ...any) {
	if a.err == nil {
		a.err = fmt.Errorf("seccomp: bpf: "+format, args...)
	}
}

// bind binds l to the next instruction emitted.
func (a *asm) bind(l label) {
	if l == next {
		a.fail("binding the empty label")
		return
	}
	if _, dup := a.labels[l]; dup {
		a.fail("label %q bound twice", l)
		return
	}
	a.labels[l] = len(a.insns)
}

func (a *asm) emit(i insn) { a.insns = append(a.insns, i) }

// ldAbs loads the 32-bit word at offset off of struct seccomp_data into A.
func (a *asm) ldAbs(off uint32) {
	a.emit(insn{code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, k: off})
}

// and sets A &= k.
func (a *asm) and(k uint32) {
	a.emit(insn{code: unix.BPF_ALU | unix.BPF_AND | unix.BPF_K, k: k})
}

// ret returns k as the filter's verdict.
func (a *asm) ret(k uint32) {
	a.emit(insn{code: unix.BPF_RET | unix.BPF_K, k: k})
}

// ja jumps unconditionally to l.
func (a *asm) ja(l label) {
	a.emit(insn{kind: kindJA, code: unix.BPF_JMP | unix.BPF_JA, target: l})
}

// jeq jumps to jt if A == k, else to jf.
func (a *asm) jeq(k uint32, jt, jf label) { a.cond(unix.BPF_JEQ, k, jt, jf) }

// jge jumps to jt if A >= k (unsigned), else to jf.
func (a *asm) jge(k uint32, jt, jf label) { a.cond(unix.BPF_JGE, k, jt, jf) }

// jset jumps to jt if A & k != 0, else to jf.
func (a *asm) jset(k uint32, jt, jf label) { a.cond(unix.BPF_JSET, k, jt, jf) }

func (a *asm) cond(op uint16, k uint32, jt, jf label) {
	a.emit(insn{kind: kindCond, code: unix.BPF_JMP | op | unix.BPF_K, k: k, jt: jt, jf: jf})
}

// resolve returns the index of the instruction l names, as seen from the
// jump at index from. next resolves to from+1.
func (a *asm) resolve(l label, from int) (int, error) {
	if l == next {
		return from + 1, nil
	}
	idx, ok := a.labels[l]
	if !ok {
		return 0, fmt.Errorf("seccomp: bpf: undefined label %q", l)
	}
	if idx <= from {
		return 0, fmt.Errorf("seccomp: bpf: jump from %d to %q (%d) is not forward", from, l, idx)
	}
	if idx >= len(a.insns) {
		return 0, fmt.Errorf("seccomp: bpf: label %q is past the last instruction", l)
	}
	return idx, nil
}

// assemble resolves labels, relaxes far jumps and returns the program.
func (a *asm) assemble() ([]unix.SockFilter, error) {
	if a.err != nil {
		return nil, a.err
	}
	n := len(a.insns)
	if n == 0 {
		return nil, fmt.Errorf("seccomp: bpf: empty program")
	}
	if last := a.insns[n-1]; last.code&0x07 != unix.BPF_RET {
		return nil, fmt.Errorf("seccomp: bpf: program does not end with a return")
	}

	// Resolve every label to an instruction index once.
	tIdx := make([]int, n)
	fIdx := make([]int, n)
	for i, in := range a.insns {
		var err error
		switch in.kind {
		case kindCond:
			if tIdx[i], err = a.resolve(in.jt, i); err != nil {
				return nil, err
			}
			if fIdx[i], err = a.resolve(in.jf, i); err != nil {
				return nil, err
			}
		case kindJA:
			if tIdx[i], err = a.resolve(in.target, i); err != nil {
				return nil, err
			}
		}
	}

	// longT[i]/longF[i]: the true/false target of conditional jump i is
	// reached through a trampoline. Relax until a fixed point; flags only
	// ever go from false to true, so this terminates.
	longT := make([]bool, n)
	longF := make([]bool, n)
	pos := make([]int, n+1)
	for {
		p := 0
		for i := range a.insns {
			pos[i] = p
			p++
			if longT[i] {
				p++
			}
			if longF[i] {
				p++
			}
		}
		pos[n] = p
		changed := false
		for i, in := range a.insns {
			if in.kind != kindCond {
				continue
			}
			if !longT[i] && pos[tIdx[i]]-(pos[i]+1) > 255 {
				longT[i], changed = true, true
			}
			if !longF[i] && pos[fIdx[i]]-(pos[i]+1) > 255 {
				longF[i], changed = true, true
			}
		}
		if !changed {
			break
		}
	}
	if pos[n] > maxInsns {
		return nil, fmt.Errorf("seccomp: bpf: program has %d instructions, limit is %d", pos[n], maxInsns)
	}

	out := make([]unix.SockFilter, 0, pos[n])
	for i, in := range a.insns {
		switch in.kind {
		case kindPlain:
			out = append(out, unix.SockFilter{Code: in.code, K: in.k})
		case kindJA:
			out = append(out, unix.SockFilter{Code: in.code, K: uint32(pos[tIdx[i]] - (pos[i] + 1))})
		case kindCond:
			after := pos[i] + 1 // where offsets count from
			var jt, jf int
			tramp := after // the next trampoline slot
			if longT[i] {
				jt = tramp - after
				tramp++
			} else {
				jt = pos[tIdx[i]] - after
			}
			if longF[i] {
				jf = tramp - after
			} else {
				jf = pos[fIdx[i]] - after
			}
			if jt < 0 || jt > 255 || jf < 0 || jf > 255 {
				// Unreachable after relaxation; fail loudly rather than
				// truncate an offset.
				return nil, fmt.Errorf("seccomp: bpf: jump at %d does not fit (jt=%d jf=%d)", pos[i], jt, jf)
			}
			out = append(out, unix.SockFilter{Code: in.code, Jt: uint8(jt), Jf: uint8(jf), K: in.k})
			if longT[i] {
				at := len(out)
				out = append(out, unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JA, K: uint32(pos[tIdx[i]] - (at + 1))})
			}
			if longF[i] {
				at := len(out)
				out = append(out, unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JA, K: uint32(pos[fIdx[i]] - (at + 1))})
			}
		}
	}
	if len(out) != pos[n] {
		return nil, fmt.Errorf("seccomp: bpf: internal error: emitted %d instructions, laid out %d", len(out), pos[n])
	}
	return out, nil
}
