package imgstore

import (
	"encoding/binary"
	"fmt"
	"os"
)

// holeBlock is the unit HoleWriter looks for zeros in: a block of a file
// whose bytes are all zero is left as a hole.
const holeBlock = 4096

// HoleWriter writes a file's contents from offset 0, leaving each block of
// holeBlock bytes (at a multiple of holeBlock) that is all zeros as a hole:
// a sparse file copied from an untrusted source (a layer's sparse entry, a
// sandbox's tar) takes on the host only the disk its data takes. Finish
// sets the file's length. It never seeks backwards, so it suits a fresh,
// empty file only.
type HoleWriter struct {
	F   *os.File
	Off int64 // bytes written so far, holes included
}

// Write writes p at w.Off, skipping the all-zero blocks.
func (w *HoleWriter) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		k := int(holeBlock - w.Off%holeBlock)
		k = min(k, len(p))
		if !allZero(p[:k]) {
			if _, err := w.F.WriteAt(p[:k], w.Off); err != nil {
				return n - len(p), err
			}
		}
		w.Off += int64(k)
		p = p[k:]
	}
	return n, nil
}

// Finish gives the file its length (a hole at the end is not written).
func (w *HoleWriter) Finish() error {
	if err := w.F.Truncate(w.Off); err != nil {
		return fmt.Errorf("%s: %w", w.F.Name(), err)
	}
	return nil
}

func allZero(b []byte) bool {
	for len(b) >= 8 {
		if binary.LittleEndian.Uint64(b) != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
