#include "textflag.h"

// func rawClone3(args unsafe.Pointer, size uintptr, prog unsafe.Pointer) (pid uintptr, errno uintptr)
//
// clone3 with the caller's arguments. The parent returns the child's pid
// or the error. The child, on the stack clone3 gave it and sharing the
// caller's memory (CLONE_VM), runs prog's system calls in order, and
// nothing else: no Go code, no TLS, no stack but its own. A call that
// fails (or returns other than its want) is reported on prog's error
// descriptor as {index, errno} and the child exits 127; the last call is
// execve, after which nothing of this runs.
//
// prog: ops *[n]op at 0, n at 8, error fd at 16, report [2]uint64 at 24;
// op: nr at 0, a0..a5 at 8..48, want at 56 (-1: any result).
TEXT ·rawClone3(SB),NOSPLIT,$0-40
	MOVQ	args+0(FP), DI
	MOVQ	size+8(FP), SI
	MOVQ	prog+16(FP), R12
	MOVQ	$435, AX // SYS_clone3
	SYSCALL
	CMPQ	AX, $0
	JEQ	child
	CMPQ	AX, $0xfffffffffffff001
	JLS	ok
	MOVQ	$-1, pid+24(FP)
	NEGQ	AX
	MOVQ	AX, errno+32(FP)
	RET
ok:
	MOVQ	AX, pid+24(FP)
	MOVQ	$0, errno+32(FP)
	RET

child:
	MOVQ	0(R12), R13 // ops
	MOVQ	8(R12), R14 // n
	XORQ	R15, R15    // index
loop:
	CMPQ	R15, R14
	JGE	exit
	MOVQ	R15, BX
	SHLQ	$6, BX
	ADDQ	R13, BX // &ops[index]
	MOVQ	0(BX), AX
	MOVQ	8(BX), DI
	MOVQ	16(BX), SI
	MOVQ	24(BX), DX
	MOVQ	32(BX), R10
	MOVQ	40(BX), R8
	MOVQ	48(BX), R9
	SYSCALL
	CMPQ	AX, $0xfffffffffffff001
	JHI	failed
	MOVQ	56(BX), CX
	CMPQ	CX, $-1
	JEQ	next
	CMPQ	AX, CX
	JEQ	next
	MOVQ	$5, AX // EIO: not what was wanted
	JMP	report
next:
	INCQ	R15
	JMP	loop
failed:
	NEGQ	AX
report:
	MOVQ	R15, 24(R12)
	MOVQ	AX, 32(R12)
	MOVQ	16(R12), DI
	LEAQ	24(R12), SI
	MOVQ	$16, DX
	MOVQ	$1, AX // SYS_write
	SYSCALL
exit:
	MOVQ	$127, DI
	MOVQ	$231, AX // SYS_exit_group
	SYSCALL
	INT	$3
