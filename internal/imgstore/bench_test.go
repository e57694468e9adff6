package imgstore

import (
	"archive/tar"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
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
