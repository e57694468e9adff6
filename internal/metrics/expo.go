package metrics

import (
	"bufio"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// The exposition: Prometheus's text format (version 0.0.4), written by cage
// itself. The official client's packages cost every cage process, `cage
// run` included, their initialisation and allocations at start (about 1 ms
// of CPU and 100 page faults here) for a page that only the daemon serves.

// maxLabels is the most labels a vector of this package has; a series is
// keyed by its label values in an array, so an update allocates nothing
// once its series exists.
const maxLabels = 3

type labelValues [maxLabels]string

// vec is a counter or (with buckets) a histogram with labels.
type vec struct {
	name, help string
	labels     []string
	buckets    []float64 // upper bounds, ascending; nil: a counter

	mu     sync.Mutex
	series map[labelValues]*series
}

// series is one combination of label values: a counter's value, or a
// histogram's sum, count and per-bucket counts (not cumulative).
type series struct {
	values labelValues
	v      float64
	n      uint64
	counts []uint64
}

func newVec(name, help string, buckets []float64, labels ...string) *vec {
	if len(labels) > maxLabels {
		panic("metrics: too many labels for " + name)
	}
	return &vec{name: name, help: help, labels: labels, buckets: buckets, series: map[labelValues]*series{}}
}

// get returns the series of values, made on first use; v.mu is held.
func (v *vec) get(values []string) *series {
	if len(values) != len(v.labels) {
		panic("metrics: " + v.name + " takes " + strconv.Itoa(len(v.labels)) + " label values")
	}
	var k labelValues
	copy(k[:], values)
	s := v.series[k]
	if s == nil {
		s = &series{values: k}
		if v.buckets != nil {
			s.counts = make([]uint64, len(v.buckets))
		}
		v.series[k] = s
	}
	return s
}

// add adds x (≥ 0) to a counter.
func (v *vec) add(x float64, values ...string) {
	v.mu.Lock()
	v.get(values).v += x
	v.mu.Unlock()
}

// observe records x in a histogram.
func (v *vec) observe(x float64, values ...string) {
	v.mu.Lock()
	s := v.get(values)
	s.v += x
	s.n++
	if i, _ := slices.BinarySearch(v.buckets, x); i < len(s.counts) {
		s.counts[i]++ // the first bound ≥ x
	}
	v.mu.Unlock()
}

// family is what one metric family shows at a scrape.
type family struct {
	name, help, typ string
	samples         []sample
}

// sample is one line: the family's name plus suffix, labels as name/value
// pairs, the value.
type sample struct {
	suffix string
	labels []string
	value  float64
}

func (f *family) add(value float64, labels ...string) {
	f.samples = append(f.samples, sample{labels: labels, value: value})
}

// family is the vector's state now, its series in the order of their
// label values; nil when it has none (a family without samples is not
// shown).
func (v *vec) family() *family {
	v.mu.Lock()
	all := make([]series, 0, len(v.series))
	for _, s := range v.series {
		c := *s
		c.counts = slices.Clone(s.counts)
		all = append(all, c)
	}
	v.mu.Unlock()
	if len(all) == 0 {
		return nil
	}
	slices.SortFunc(all, func(a, b series) int { return slices.Compare(a.values[:], b.values[:]) })
	f := &family{name: v.name, help: v.help, typ: "counter"}
	if v.buckets != nil {
		f.typ = "histogram"
	}
	for _, s := range all {
		labels := make([]string, 0, 2*len(v.labels)+2)
		for i, l := range v.labels {
			labels = append(labels, l, s.values[i])
		}
		if v.buckets == nil {
			f.add(s.v, labels...)
			continue
		}
		var cum uint64
		for i, b := range v.buckets {
			cum += s.counts[i]
			f.samples = append(f.samples, sample{suffix: "_bucket", labels: append(slices.Clip(labels), "le", formatFloat(b)), value: float64(cum)})
		}
		f.samples = append(f.samples,
			sample{suffix: "_bucket", labels: append(slices.Clip(labels), "le", "+Inf"), value: float64(s.n)},
			sample{suffix: "_sum", labels: labels, value: s.v},
			sample{suffix: "_count", labels: labels, value: float64(s.n)})
	}
	return f
}

// writeText writes the families, sorted by name, in the text format; the
// samples of families of one name go under one header (the format allows a
// family once).
func writeText(w io.Writer, fams []*family) error {
	fams = slices.DeleteFunc(fams, func(f *family) bool { return f == nil || len(f.samples) == 0 })
	slices.SortStableFunc(fams, func(a, b *family) int { return strings.Compare(a.name, b.name) })
	bw := bufio.NewWriter(w)
	for i, f := range fams {
		if i > 0 && fams[i-1].name == f.name {
			writeSamples(bw, f)
			continue
		}
		bw.WriteString("# HELP ")
		bw.WriteString(f.name)
		bw.WriteByte(' ')
		bw.WriteString(helpEscaper.Replace(f.help))
		bw.WriteString("\n# TYPE ")
		bw.WriteString(f.name)
		bw.WriteByte(' ')
		bw.WriteString(f.typ)
		bw.WriteByte('\n')
		writeSamples(bw, f)
	}
	return bw.Flush()
}

func writeSamples(bw *bufio.Writer, f *family) {
	for _, s := range f.samples {
		bw.WriteString(f.name)
		bw.WriteString(s.suffix)
		if len(s.labels) > 0 {
			bw.WriteByte('{')
			for i := 0; i+1 < len(s.labels); i += 2 {
				if i > 0 {
					bw.WriteByte(',')
				}
				bw.WriteString(s.labels[i])
				bw.WriteString(`="`)
				bw.WriteString(valueEscaper.Replace(s.labels[i+1]))
				bw.WriteByte('"')
			}
			bw.WriteByte('}')
		}
		bw.WriteByte(' ')
		bw.WriteString(formatFloat(s.value))
		bw.WriteByte('\n')
	}
}

var (
	helpEscaper  = strings.NewReplacer(`\`, `\\`, "\n", `\n`)
	valueEscaper = strings.NewReplacer(`\`, `\\`, "\n", `\n`, `"`, `\"`)
)

func formatFloat(f float64) string {
	switch {
	case math.IsInf(f, 1):
		return "+Inf"
	case math.IsInf(f, -1):
		return "-Inf"
	case math.IsNaN(f):
		return "NaN"
	}
	return strconv.FormatFloat(f, 'g', -1, 64)
}
