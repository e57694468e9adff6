package imgstore

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/cagehq/cage/internal/testutil"
)

// BenchmarkImport100MiB: import a `docker save` tarball of a 100 MiB image
// (4 gzip layers of 25 incompressible 1 MiB files) into an empty store.
// Reports p50/p95/p99 and the rate; building the tarball is not timed.
func BenchmarkImport100MiB(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("SKIP: needs root")
	}
	rng := rand.New(rand.NewChaCha8([32]byte{1}))
	var layers []v1.Layer
	for l := 0; l < 4; l++ {
		var entries []testutil.TarEntry
		entries = append(entries, testutil.TarEntry{Name: fmt.Sprintf("data%d/", l), Type: tar.TypeDir})
		for f := 0; f < 25; f++ {
			body := make([]byte, 1<<20)
			for i := 0; i < len(body); i += 8 {
				v := rng.Uint64()
				for j := 0; j < 8; j++ {
					body[i+j] = byte(v >> (8 * j))
				}
			}
			entries = append(entries, testutil.TarEntry{Name: fmt.Sprintf("data%d/f%02d", l, f), Body: body})
		}
		layers = append(layers, testutil.Layer(b, testutil.LayerTar(b, entries)))
	}
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		b.Fatal(err)
	}
	path := testutil.WriteDockerArchive(b, img, "big:latest")
	fi, _ := os.Stat(path)
	var samples []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		dir := filepath.Join(b.TempDir(), "templates")
		s, err := Open(dir)
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		start := time.Now()
		if _, err := s.Import(context.Background(), path, "big", Options{}); err != nil {
			b.Fatal(err)
		}
		samples = append(samples, time.Since(start))
		b.StopTimer()
		_ = os.RemoveAll(dir)
		b.StartTimer()
	}
	slices.Sort(samples)
	pct := func(p float64) time.Duration { return samples[min(len(samples)-1, int(p*float64(len(samples))))] }
	b.ReportMetric(float64(pct(0.50).Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(pct(0.95).Microseconds())/1000, "p95-ms")
	b.ReportMetric(float64(pct(0.99).Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(fi.Size())/1e6/pct(0.50).Seconds(), "MB/s-p50")
}

// manyEntriesLayer is an uncompressed layer of n entries in one of two
// shapes: "tree", directories of 100 entries each (a directory, then 99
// empty files), as a large image has; "replace", 64 directories deep, n/2
// directories each replaced at once by a file of the same name (a hostile
// layer: each replacement made the old unpacker forget every directory it
// knew, and the next entry walked its 64 parents again, each from the top).
func manyEntriesLayer(b *testing.B, shape string, n int) []byte {
	b.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mtime := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	add := func(name string, typ byte) {
		mode := int64(0o644)
		if typ == tar.TypeDir {
			mode = 0o755
		}
		if err := tw.WriteHeader(&tar.Header{Name: name, Typeflag: typ, Mode: mode, ModTime: mtime}); err != nil {
			b.Fatal(err)
		}
	}
	switch shape {
	case "tree":
		for d := 0; d*100 < n; d++ {
			add(fmt.Sprintf("usr/share/d%05d/", d), tar.TypeDir)
			for f := 1; f < 100 && d*100+f < n; f++ {
				add(fmt.Sprintf("usr/share/d%05d/f%02d", d, f), tar.TypeReg)
			}
		}
	case "replace":
		deep := strings.Repeat("r/", 64)
		for i := 0; i < n/2; i++ {
			add(fmt.Sprintf("%se%06d/", deep, i), tar.TypeDir)
			add(fmt.Sprintf("%se%06d", deep, i), tar.TypeReg)
		}
	}
	if err := tw.Close(); err != nil {
		b.Fatal(err)
	}
	return buf.Bytes()
}

// BenchmarkImportEntries: import a one-layer image of 200,000 entries (see
// manyEntriesLayer for the shapes) into an empty store. Reports the time per
// import, entries per second and the heap's peak over the import (sampled
// every 5 ms), which must not grow with the number of entries.
func BenchmarkImportEntries(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("SKIP: needs root")
	}
	n := 200_000
	if s := os.Getenv("CAGE_BENCH_ENTRIES"); s != "" {
		fmt.Sscan(s, &n)
	}
	for _, shape := range []string{"tree", "replace"} {
		b.Run(shape, func(b *testing.B) {
			raw := manyEntriesLayer(b, shape, n)
			img, err := mutate.AppendLayers(empty.Image, testutil.Layer(b, raw))
			if err != nil {
				b.Fatal(err)
			}
			path := testutil.WriteDockerArchive(b, img, "many:latest")
			var peak uint64
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				dir := filepath.Join(b.TempDir(), "templates")
				s, err := Open(dir)
				if err != nil {
					b.Fatal(err)
				}
				runtime.GC()
				stop := sampleHeap(&peak)
				b.StartTimer()
				if _, err := s.Import(context.Background(), path, "many", Options{}); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				stop()
				_ = os.RemoveAll(dir)
				b.StartTimer()
			}
			b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "entries/s")
			b.ReportMetric(float64(peak)/(1<<20), "peak-heap-MiB")
		})
	}
}

// sampleHeap records the largest live heap seen until stop is called.
func sampleHeap(peak *uint64) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	sample := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	go func() {
		defer close(finished)
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			metrics.Read(sample)
			if v := sample[0].Value.Uint64(); v > *peak {
				*peak = v
			}
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	}()
	return func() { close(done); <-finished }
}
