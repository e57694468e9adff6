package vm

import "testing"

// TestTBCount: the count is read from QEMU 7.2's `info jit` (lines end
// in CRLF), 0 under KVM, and a text without one is an error, not a 0.
func TestTBCount(t *testing.T) {
	tcg := "Translation buffer state:\r\ngen code size       101619/1073736704\r\nTB count            170\r\nTB avg target size  18 max=254 bytes\r\ncross page TB count 0 (0%)\r\n"
	if n, err := tbCount(tcg); err != nil || n != 170 {
		t.Errorf("tbCount(TCG's text) = %d, %v; want 170", n, err)
	}
	if n, err := tbCount("JIT information is only available with accel=tcg\r\n"); err != nil || n != 0 {
		t.Errorf("tbCount(KVM's text) = %d, %v; want 0", n, err)
	}
	if n, err := tbCount("unknown command: 'info jit'\r\n"); err == nil {
		t.Errorf("tbCount(no count) = %d, nil; want an error", n)
	}
}
