package metrics

import (
	"bytes"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// goFamilies is the Go runtime's state, under the names Prometheus's Go
// client gives it (go_*), so dashboards made for Go programs read it.
func goFamilies() []*family {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	threads, _ := runtime.ThreadCreateProfile(nil)
	fams := []*family{
		gaugeFamily("go_goroutines", "Number of goroutines that currently exist.", float64(runtime.NumGoroutine())),
		gaugeFamily("go_threads", "Number of OS threads created.", float64(threads)),
		gaugeFamily("go_sched_gomaxprocs_threads", "The current runtime.GOMAXPROCS setting.", float64(runtime.GOMAXPROCS(0))),
	}
	info := &family{name: "go_info", help: "Information about the Go environment.", typ: "gauge"}
	info.add(1, "version", runtime.Version())
	fams = append(fams, info)

	var gc debug.GCStats
	gc.PauseQuantiles = make([]time.Duration, 5)
	debug.ReadGCStats(&gc)
	pauses := &family{name: "go_gc_duration_seconds", help: "A summary of the wall-time pause (stop-the-world) duration in garbage collection cycles.", typ: "summary"}
	for i, q := range []string{"0", "0.25", "0.5", "0.75", "1"} {
		pauses.add(gc.PauseQuantiles[i].Seconds(), "quantile", q)
	}
	pauses.samples = append(pauses.samples,
		sample{suffix: "_sum", value: gc.PauseTotal.Seconds()},
		sample{suffix: "_count", value: float64(gc.NumGC)})
	fams = append(fams, pauses)

	for _, m := range []struct {
		name, help string
		counter    bool
		v          uint64
	}{
		{"alloc_bytes", "Number of bytes allocated in heap and currently in use.", false, ms.Alloc},
		{"alloc_bytes_total", "Total number of bytes allocated in heap until now, even if released already.", true, ms.TotalAlloc},
		{"sys_bytes", "Number of bytes obtained from system.", false, ms.Sys},
		{"mallocs_total", "Total number of heap objects allocated.", true, ms.Mallocs},
		{"frees_total", "Total number of heap objects frees.", true, ms.Frees},
		{"heap_alloc_bytes", "Number of heap bytes allocated and currently in use.", false, ms.HeapAlloc},
		{"heap_sys_bytes", "Number of heap bytes obtained from system.", false, ms.HeapSys},
		{"heap_idle_bytes", "Number of heap bytes waiting to be used.", false, ms.HeapIdle},
		{"heap_inuse_bytes", "Number of heap bytes that are in use.", false, ms.HeapInuse},
		{"heap_released_bytes", "Number of heap bytes released to OS.", false, ms.HeapReleased},
		{"heap_objects", "Number of currently allocated objects.", false, ms.HeapObjects},
		{"stack_inuse_bytes", "Number of bytes obtained from system for stack allocator in non-CGO environments.", false, ms.StackInuse},
		{"stack_sys_bytes", "Number of bytes obtained from system for stack allocator.", false, ms.StackSys},
		{"mspan_inuse_bytes", "Number of bytes in use by mspan structures.", false, ms.MSpanInuse},
		{"mspan_sys_bytes", "Number of bytes used for mspan structures obtained from system.", false, ms.MSpanSys},
		{"mcache_inuse_bytes", "Number of bytes in use by mcache structures.", false, ms.MCacheInuse},
		{"mcache_sys_bytes", "Number of bytes used for mcache structures obtained from system.", false, ms.MCacheSys},
		{"buck_hash_sys_bytes", "Number of bytes used by the profiling bucket hash table.", false, ms.BuckHashSys},
		{"gc_sys_bytes", "Number of bytes used for garbage collection system metadata.", false, ms.GCSys},
		{"other_sys_bytes", "Number of bytes used for other system allocations.", false, ms.OtherSys},
		{"next_gc_bytes", "Number of heap bytes when next garbage collection will take place.", false, ms.NextGC},
	} {
		f := gaugeFamily("go_memstats_"+m.name, m.help, float64(m.v))
		if m.counter {
			f.typ = "counter"
		}
		fams = append(fams, f)
	}
	return append(fams, gaugeFamily("go_memstats_last_gc_time_seconds", "Number of seconds since 1970 of last garbage collection.",
		float64(ms.LastGC)/1e9))
}

// processFamilies is this process's CPU, memory and descriptors from
// /proc/self (process_*, as Prometheus's process collector names them); a
// figure that cannot be read is left out.
func processFamilies() []*family {
	var fams []*family
	if st, err := readSelfStat(); err == nil {
		fams = append(fams,
			&family{name: "process_cpu_seconds_total", help: "Total user and system CPU time spent in seconds.", typ: "counter",
				samples: []sample{{value: float64(st.utime+st.stime) / userHZ}}},
			gaugeFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.", float64(st.vsize)),
			gaugeFamily("process_resident_memory_bytes", "Resident memory size in bytes.", float64(st.rss*int64(os.Getpagesize()))))
		if boot, err := bootTime(); err == nil {
			fams = append(fams, gaugeFamily("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
				float64(boot)+float64(st.start)/userHZ))
		}
	}
	if fds, err := os.ReadDir("/proc/self/fd"); err == nil {
		fams = append(fams, gaugeFamily("process_open_fds", "Number of open file descriptors.", float64(len(fds))))
	}
	var lim unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &lim) == nil {
		fams = append(fams, gaugeFamily("process_max_fds", "Maximum number of open file descriptors.", float64(lim.Cur)))
	}
	return fams
}

// userHZ is the unit of /proc's CPU times (USER_HZ: 100 on every Linux
// architecture Go supports).
const userHZ = 100

type selfStat struct {
	utime, stime, start uint64
	vsize               uint64
	rss                 int64
}

// readSelfStat reads /proc/self/stat; its second field, the command in
// parentheses, may hold spaces, so fields are counted from its end.
func readSelfStat() (selfStat, error) {
	var st selfStat
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return st, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return st, os.ErrInvalid
	}
	f := bytes.Fields(b[i+1:]) // f[0] is field 3 (state)
	if len(f) < 22 {
		return st, os.ErrInvalid
	}
	num := func(field int) uint64 {
		n, e := strconv.ParseUint(string(f[field-3]), 10, 64)
		if e != nil && err == nil {
			err = e
		}
		return n
	}
	st.utime, st.stime, st.start, st.vsize = num(14), num(15), num(22), num(23)
	st.rss = int64(num(24))
	return st, err
}

// bootTime is the host's boot time in seconds since the epoch (/proc/stat's
// btime).
func bootTime() (uint64, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, err
	}
	for line := range bytes.Lines(b) {
		if v, ok := bytes.CutPrefix(line, []byte("btime ")); ok {
			return strconv.ParseUint(string(bytes.TrimSpace(v)), 10, 64)
		}
	}
	return 0, os.ErrNotExist
}

func gaugeFamily(name, help string, v float64) *family {
	return &family{name: name, help: help, typ: "gauge", samples: []sample{{value: v}}}
}
