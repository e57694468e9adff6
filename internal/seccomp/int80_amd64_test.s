#include "textflag.h"

// func int80getpid() int32
//
// Calls getpid through the i386 ABI (int $0x80, eax = 20, the i386 number of
// getpid) from 64-bit code and returns eax: a pid, or -errno.
//
// Note: the go command treats a .s file as part of the package proper, not
// as a test file, so this function is also assembled into the non-test
// package; nothing there references it and the linker drops it.
TEXT ·int80getpid(SB), NOSPLIT, $0-4
	MOVL	$20, AX
	INT	$0x80
	MOVL	AX, ret+0(FP)
	RET
