package volume

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil"
)

// reportPercentiles reports the p50, p95 and p99 of ds in milliseconds.
func reportPercentiles(b *testing.B, ds []time.Duration) {
	if len(ds) == 0 {
		return
	}
	slices.Sort(ds)
	at := func(p float64) float64 {
		return float64(ds[min(len(ds)-1, int(p*float64(len(ds))))].Microseconds()) / 1000
	}
	b.ReportMetric(at(0.50), "p50-ms")
	b.ReportMetric(at(0.95), "p95-ms")
	b.ReportMetric(at(0.99), "p99-ms")
}

// BenchmarkVolumeCreate: a new volume of 1 GiB, made (sparse image,
// mke2fs, mount, lost+found gone) and removed.
func BenchmarkVolumeCreate(b *testing.B) {
	testutil.RequireRoot(b)
	m := New(Config{Data: b.TempDir(), RunDir: b.TempDir(), Size: DefaultSize})
	var ds []time.Duration
	for i := 0; b.Loop(); i++ {
		id := "bench" + strconv.Itoa(i)
		start := time.Now()
		if err := m.Create(id); err != nil {
			b.Fatal(err)
		}
		ds = append(ds, time.Since(start))
		if err := m.Remove(id); err != nil {
			b.Fatal(err)
		}
	}
	reportPercentiles(b, ds)
}

// BenchmarkVolumeWrite: a 1 MiB file written through the content API's
// Write (a new file renamed into place), against the same bytes written
// with os.WriteFile to a file of the host's temporary directory (the peer).
func BenchmarkVolumeWrite(b *testing.B) {
	testutil.RequireRoot(b)
	m := New(Config{Data: b.TempDir(), RunDir: b.TempDir(), Size: 64 << 20})
	if err := m.Create("benchw"); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = m.Remove("benchw") })
	r, err := m.Open("benchw")
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	data := bytes.Repeat([]byte("x"), 1<<20)
	peer := filepath.Join(b.TempDir(), "peer")
	for _, c := range []struct {
		name  string
		write func() error
	}{
		{"volume", func() error { _, err := r.Write("/f", bytes.NewReader(data), Meta{}, false); return err }},
		{"peer-os.WriteFile", func() error { return os.WriteFile(peer, data, 0o644) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			var ds []time.Duration
			for b.Loop() {
				start := time.Now()
				if err := c.write(); err != nil {
					b.Fatal(err)
				}
				ds = append(ds, time.Since(start))
			}
			reportPercentiles(b, ds)
		})
	}
}
