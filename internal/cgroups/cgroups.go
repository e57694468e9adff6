// Package cgroups puts sandboxes in control groups and enforces their memory
// (swap included), CPU and process-count limits from the host side. It works
// on cgroup v2, on cgroup v1, and on the v1/v2 hybrid where the controllers
// are v1 hierarchies and cgroup2 is mounted beside them without controllers.
//
// Every sandbox gets a group named after it below a parent ("cage") in each
// hierarchy that has a controller cage uses; on v1 those of the process and
// runc walls also get a child in the pids hierarchy for their workload
// (SplitPids).
package cgroups

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Mode is the layout of the host's cgroup hierarchies.
type Mode int

const (
	V1     Mode = iota + 1 // v1 controllers only
	Hybrid                 // v1 controllers, cgroup2 mounted without them
	V2                     // unified hierarchy with the controllers
)

func (m Mode) String() string {
	switch m {
	case V1:
		return "v1"
	case Hybrid:
		return "hybrid (v1 controllers, v2 mounted empty)"
	case V2:
		return "v2"
	}
	return "unknown"
}

// controllers cage uses on v1. cpuacct feeds CPU usage figures; freezer
// pauses a sandbox.
var v1Controllers = []string{"memory", "cpu", "cpuacct", "pids", "freezer"}

// v2Controllers must be enabled in the parents' cgroup.subtree_control.
var v2Controllers = []string{"memory", "cpu", "pids"}

// Limits are a sandbox's resource limits; a zero field means unlimited.
type Limits struct {
	MemoryBytes int64   // RAM, swap included (swap is never granted)
	CPUs        float64 // CPU bandwidth in cores
	Pids        int64   // tasks (processes and threads)
}

// Manager creates sandbox cgroups on this host.
type Manager struct {
	Mode   Mode
	v1     map[string]string // controller -> mountpoint of its hierarchy (v1, hybrid)
	v2     string            // cgroup2 mountpoint (v2, and hybrid's empty one)
	all    []string          // every cgroup hierarchy mounted (runtimes use them all)
	Parent string            // parent group below each hierarchy's root
}

// Detect reads the host's cgroup layout from /proc/self/mountinfo.
func Detect(parent string) (*Manager, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	m := &Manager{v1: map[string]string{}, Parent: parent}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		sep := -1
		for i, s := range fields {
			if s == "-" {
				sep = i
				break
			}
		}
		if sep < 0 || len(fields) < sep+4 {
			continue
		}
		mnt, fstype, opts := fields[4], fields[sep+1], fields[sep+3]
		if fstype == "cgroup" || fstype == "cgroup2" {
			m.all = append(m.all, mnt)
		}
		switch fstype {
		case "cgroup2":
			if m.v2 == "" {
				m.v2 = mnt
			}
		case "cgroup":
			for _, o := range strings.Split(opts, ",") {
				for _, c := range v1Controllers {
					if o == c && m.v1[c] == "" {
						m.v1[c] = mnt
					}
				}
			}
		}
	}
	switch {
	case len(m.v1) > 0 && m.v2 != "":
		m.Mode = Hybrid
	case len(m.v1) > 0:
		m.Mode = V1
	case m.v2 != "":
		m.Mode = V2
	default:
		return nil, errors.New("no cgroup filesystem is mounted")
	}
	if m.Mode != V2 {
		for _, c := range []string{"memory", "pids"} {
			if m.v1[c] == "" {
				return nil, fmt.Errorf("the cgroup v1 %s controller is not mounted", c)
			}
		}
	} else if err := m.enableV2(); err != nil {
		return nil, err
	}
	return m, nil
}

// enableV2 turns the controllers on for the root and cage's parent group.
func (m *Manager) enableV2() error {
	avail, err := os.ReadFile(filepath.Join(m.v2, "cgroup.controllers"))
	if err != nil {
		return err
	}
	for _, c := range v2Controllers {
		if !strings.Contains(" "+strings.TrimSpace(string(avail))+" ", " "+c+" ") {
			return fmt.Errorf("the cgroup v2 %s controller is not available", c)
		}
	}
	parent := filepath.Join(m.v2, m.Parent)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return err
	}
	ctl := "+" + strings.Join(v2Controllers, " +")
	for _, dir := range []string{m.v2, parent} {
		if err := os.WriteFile(filepath.Join(dir, "cgroup.subtree_control"), []byte(ctl), 0); err != nil {
			return fmt.Errorf("enable cgroup controllers in %s: %w", dir, err)
		}
	}
	return nil
}

// Cgroup is one sandbox's group in every hierarchy.
type Cgroup struct {
	m    *Manager
	Name string
	dirs map[string]string // controller (or "unified") -> directory

	// workload is the child group of the pids hierarchy that holds the
	// sandbox's workload (SplitPids), "" when there is none; reserve is
	// how many of the group's pids the workload may not take.
	workload string
	reserve  int64
}

// workloadGroup names the child group of SplitPids.
const workloadGroup = "workload"

// SplitPids makes, on cgroup v1 (and the hybrid), a child of the group in
// the pids hierarchy for the sandbox's workload, whose limit Apply keeps
// reserve below the group's; it returns that child's tasks file, opened
// for writing. A thread that writes "0" there moves itself alone (v1
// places threads, not processes), and what it forks from then on is born
// in the child: the sandbox's agent moves the one thread it forks from,
// and so holds reserve pids that no workload can take, without taking
// them ahead. The file was opened by the host: the kernel checks a move
// against the opener's credentials, so the agent may write to it from
// its user namespace. On v2 a process's threads share its group (the
// pids controller's threaded mode would change the whole subtree): it
// returns nil, and the agent takes its threads ahead instead.
func (cg *Cgroup) SplitPids(reserve int64) (*os.File, error) {
	if cg.m.Mode == V2 {
		return nil, nil
	}
	dir := filepath.Join(cg.dirs["pids"], workloadGroup)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, err
	}
	cg.workload, cg.reserve = dir, reserve
	return os.OpenFile(filepath.Join(dir, "tasks"), os.O_WRONLY|syscall.O_CLOEXEC, 0)
}

// Create makes the sandbox's group and applies its limits. On failure nothing
// is left behind.
func (m *Manager) Create(name string, lim Limits) (cg *Cgroup, err error) {
	cg = &Cgroup{m: m, Name: name, dirs: map[string]string{}}
	defer func() {
		if err != nil {
			_ = cg.Destroy()
			cg = nil
		}
	}()
	if m.Mode == V2 {
		dir := filepath.Join(m.v2, m.Parent, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			return nil, err
		}
		cg.dirs["unified"] = dir
	} else {
		for c, mnt := range m.v1 {
			if err := os.MkdirAll(filepath.Join(mnt, m.Parent), 0o755); err != nil {
				return nil, err
			}
			dir := filepath.Join(mnt, m.Parent, name)
			if err := os.Mkdir(dir, 0o755); err != nil {
				return nil, err
			}
			cg.dirs[c] = dir
		}
	}
	return cg, cg.Apply(lim)
}

// V2At is the manager of a cgroup2 hierarchy whose root is dir, with
// controllers enabled already (by Detect, when it was mounted): for a
// hierarchy reached through a descriptor once its mount is out of reach
// (the microvm guest's, after its root has changed).
func V2At(dir, parent string) *Manager {
	return &Manager{Mode: V2, v2: dir, all: []string{dir}, Parent: parent}
}

// Open returns the group of an existing sandbox (after a restart).
func (m *Manager) Open(name string) *Cgroup {
	cg := &Cgroup{m: m, Name: name, dirs: map[string]string{}}
	if m.Mode == V2 {
		cg.dirs["unified"] = filepath.Join(m.v2, m.Parent, name)
	} else {
		for c, mnt := range m.v1 {
			cg.dirs[c] = filepath.Join(mnt, m.Parent, name)
		}
		if dir := filepath.Join(cg.dirs["pids"], workloadGroup); exists(dir) {
			cg.workload = dir
			cg.reserve = max(0, readInt(cg.dirs["pids"], "pids.max")-readInt(dir, "pids.max"))
		}
	}
	return cg
}

// readInt reads a number from a cgroup file (0 if it holds none: "max").
func readInt(dir, file string) int64 {
	b, _ := os.ReadFile(filepath.Join(dir, file))
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n
}

// List names the sandbox groups that exist under the parent.
func (m *Manager) List() ([]string, error) {
	dir := filepath.Join(m.v2, m.Parent)
	if m.Mode != V2 {
		dir = filepath.Join(m.v1["pids"], m.Parent)
	}
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	var names []string
	for _, e := range ents {
		if e.IsDir() {
			names = append(names, e.Name())
		}
	}
	return names, err
}

func (cg *Cgroup) write(ctrl, file, val string) error {
	dir, ok := cg.dirs[ctrl]
	if !ok {
		return nil
	}
	if err := os.WriteFile(filepath.Join(dir, file), []byte(val), 0); err != nil {
		return fmt.Errorf("cgroup %s: %w", file, err)
	}
	return nil
}

func exists(p string) bool { _, err := os.Stat(p); return err == nil }

// Apply writes the limits (zero fields are left as they are).
func (cg *Cgroup) Apply(lim Limits) error {
	if cg.m.Mode == V2 {
		return cg.applyV2(lim)
	}
	if lim.MemoryBytes > 0 {
		v := strconv.FormatInt(lim.MemoryBytes, 10)
		if err := cg.write("memory", "memory.limit_in_bytes", v); err != nil {
			return err
		}
		if exists(filepath.Join(cg.dirs["memory"], "memory.memsw.limit_in_bytes")) {
			if err := cg.write("memory", "memory.memsw.limit_in_bytes", v); err != nil {
				return err
			}
		}
		_ = cg.write("memory", "memory.swappiness", "0")
		// v1 charges TCP's buffers to no group unless the group has a TCP
		// limit: a sandbox of 256 MiB queued 2.2 GiB of kernel memory in
		// loopback connections, and brought the host's TCP (tcp_mem, shared
		// by every socket of the host) to its limit (found by review,
		// 2026-12-03). With one, they are the group's, up to its memory
		// limit (v2 charges them to memory.max).
		if exists(filepath.Join(cg.dirs["memory"], "memory.kmem.tcp.limit_in_bytes")) {
			if err := cg.write("memory", "memory.kmem.tcp.limit_in_bytes", v); err != nil {
				return err
			}
		}
	}
	if lim.CPUs > 0 {
		if err := cg.write("cpu", "cpu.cfs_period_us", "100000"); err != nil {
			return err
		}
		quota := int64(lim.CPUs * 100000)
		if err := cg.write("cpu", "cpu.cfs_quota_us", strconv.FormatInt(quota, 10)); err != nil {
			return err
		}
	}
	if lim.Pids > 0 {
		if err := cg.write("pids", "pids.max", strconv.FormatInt(lim.Pids, 10)); err != nil {
			return err
		}
		if cg.workload != "" {
			v := strconv.FormatInt(max(1, lim.Pids-cg.reserve), 10)
			if err := os.WriteFile(filepath.Join(cg.workload, "pids.max"), []byte(v), 0); err != nil {
				return fmt.Errorf("set pids.max of the workload: %w", err)
			}
		}
	}
	return nil
}

func (cg *Cgroup) applyV2(lim Limits) error {
	if lim.MemoryBytes > 0 {
		if err := cg.write("unified", "memory.max", strconv.FormatInt(lim.MemoryBytes, 10)); err != nil {
			return err
		}
		if exists(filepath.Join(cg.dirs["unified"], "memory.swap.max")) {
			if err := cg.write("unified", "memory.swap.max", "0"); err != nil {
				return err
			}
		}
	}
	if lim.CPUs > 0 {
		v := fmt.Sprintf("%d 100000", int64(lim.CPUs*100000))
		if err := cg.write("unified", "cpu.max", v); err != nil {
			return err
		}
	}
	if lim.Pids > 0 {
		return cg.write("unified", "pids.max", strconv.FormatInt(lim.Pids, 10))
	}
	return nil
}

// SetBackground gives the group the least CPU weight against its siblings
// (on: cpu.weight 1 on v2, cpu.shares 2 on v1), or the default back (off:
// 100, 1024). It is what makes a pool's refill yield to the sandboxes
// running beside it, which nice does not: nice orders the threads within
// their own group only, and each sandbox has one (measured, 2026-12-05:
// two busy loops on one CPU in sibling groups, nice 0 and nice 15, had
// 1.516 s and 1.515 s of it in 3 s).
func (cg *Cgroup) SetBackground(on bool) error {
	if cg.m.Mode == V2 {
		v := "100"
		if on {
			v = "1"
		}
		return cg.write("unified", "cpu.weight", v)
	}
	v := "1024"
	if on {
		v = "2"
	}
	return cg.write("cpu", "cpu.shares", v)
}

// Dir returns the group's directory for a controller ("unified" on v2).
func (cg *Cgroup) Dir(ctrl string) string {
	if cg.m.Mode == V2 {
		return cg.dirs["unified"]
	}
	return cg.dirs[ctrl]
}

// AddProc moves pid into the group in every hierarchy.
func (cg *Cgroup) AddProc(pid int) error {
	for _, dir := range cg.dirs {
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("join cgroup %s: %w", dir, err)
		}
	}
	return nil
}

// OOMEventsFile and PidsEventsFile hold the counters of limit hits: an
// "oom_kill N" line and a "max N" line.
func (cg *Cgroup) OOMEventsFile() string {
	if cg.m.Mode == V2 {
		return filepath.Join(cg.dirs["unified"], "memory.events")
	}
	return filepath.Join(cg.dirs["memory"], "memory.oom_control")
}

// A workload that SplitPids set apart hits its own group's limit, which
// counts there.
func (cg *Cgroup) PidsEventsFile() string {
	if cg.workload != "" {
		return filepath.Join(cg.workload, "pids.events")
	}
	return filepath.Join(cg.Dir("pids"), "pids.events")
}

// Procs lists the pids in the group, its workload's group included (a
// process with threads in both is listed once).
func (cg *Cgroup) Procs() []int {
	var pids []int
	seen := map[int]bool{}
	for _, dir := range []string{cg.Dir("pids"), cg.workload} {
		if dir == "" {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(data)) {
			if n, err := strconv.Atoi(f); err == nil && !seen[n] {
				seen[n] = true
				pids = append(pids, n)
			}
		}
	}
	return pids
}

// Destroy kills whatever is still in the group and removes it everywhere:
// in the hierarchies cage uses and in every other one (an OCI runtime makes
// the group in all of them). It returns only after the directories are gone
// (or an error).
func (cg *Cgroup) Destroy() error {
	var firstErr error
	done := map[string]bool{}
	// The workload's group first: a group with a child cannot be removed.
	if cg.workload != "" {
		if err := removeGroup(cg.workload); err != nil {
			firstErr = err
		}
	}
	for _, dir := range cg.dirs {
		done[dir] = true
		if err := removeGroup(dir); err != nil && firstErr == nil {
			firstErr = err
		}
	}
	for _, mnt := range cg.m.all {
		dir := filepath.Join(mnt, cg.m.Parent, cg.Name)
		if done[dir] {
			continue
		}
		if _, err := os.Stat(dir); err != nil {
			continue
		}
		if err := removeGroup(dir); err != nil && firstErr == nil {
			firstErr = err
		}
	}
	return firstErr
}

func removeGroup(dir string) error {
	// A frozen process does not die of SIGKILL until it is thawed.
	thawDir(dir)
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := syscall.Rmdir(dir)
		if err == nil || errors.Is(err, syscall.ENOENT) {
			return nil
		}
		if !errors.Is(err, syscall.EBUSY) || time.Now().After(deadline) {
			return fmt.Errorf("remove cgroup %s: %w", dir, err)
		}
		// Something is still inside: kill it (a process that raced into the
		// group, or a straggler of a sandbox whose init died).
		if data, rerr := os.ReadFile(filepath.Join(dir, "cgroup.procs")); rerr == nil {
			for _, f := range strings.Fields(string(data)) {
				if pid, _ := strconv.Atoi(f); pid > 0 {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
		if exists(filepath.Join(dir, "cgroup.kill")) {
			_ = os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// Counter reads a "key N" line from an open cgroup event file.
func Counter(f *os.File, key string) uint64 {
	buf := make([]byte, 1024)
	n, _ := f.ReadAt(buf, 0)
	for _, line := range strings.Split(string(buf[:n]), "\n") {
		k, v, ok := strings.Cut(line, " ")
		if ok && k == key {
			n, _ := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	return 0
}

// EventFiles are a group's event counters opened on the host, for an agent
// that reads them from inside the sandbox, where the files are not visible.
// A nil file reads as zero.
type EventFiles struct{ OOM, Pids *os.File }

// OOMKills is how many processes the OOM killer has killed in the group.
func (e EventFiles) OOMKills() uint64 {
	if e.OOM == nil {
		return 0
	}
	return Counter(e.OOM, "oom_kill")
}

// PidsMax is how many forks the pids limit has refused.
func (e EventFiles) PidsMax() uint64 {
	if e.Pids == nil {
		return 0
	}
	return Counter(e.Pids, "max")
}

// Usage is what a sandbox's group has used.
type Usage struct {
	CPUNanos    uint64 // CPU time consumed since creation
	MemoryBytes int64  // memory charged now
	CacheBytes  int64  // of which page cache (files, tmpfs)
	MemoryLimit int64
}

// Usage reads the group's counters.
func (cg *Cgroup) Usage() (Usage, error) {
	var u Usage
	read := func(ctrl, file string) string {
		b, _ := os.ReadFile(filepath.Join(cg.Dir(ctrl), file))
		return strings.TrimSpace(string(b))
	}
	num := func(s string) int64 { n, _ := strconv.ParseInt(s, 10, 64); return n }
	stat := func(ctrl, file, key string) int64 {
		for _, line := range strings.Split(read(ctrl, file), "\n") {
			if k, v, ok := strings.Cut(line, " "); ok && k == key {
				return num(v)
			}
		}
		return 0
	}
	if cg.m.Mode == V2 {
		u.CPUNanos = uint64(stat("cpu", "cpu.stat", "usage_usec")) * 1000
		u.MemoryBytes = num(read("memory", "memory.current"))
		u.CacheBytes = stat("memory", "memory.stat", "file")
		if l := read("memory", "memory.max"); l != "max" {
			u.MemoryLimit = num(l)
		}
	} else {
		u.CPUNanos = uint64(num(read("cpuacct", "cpuacct.usage")))
		u.MemoryBytes = num(read("memory", "memory.usage_in_bytes"))
		u.CacheBytes = stat("memory", "memory.stat", "cache")
		u.MemoryLimit = num(read("memory", "memory.limit_in_bytes"))
	}
	if u.MemoryBytes == 0 && u.CPUNanos == 0 {
		if _, err := os.Stat(cg.Dir("memory")); err != nil {
			return u, err
		}
	}
	return u, nil
}
