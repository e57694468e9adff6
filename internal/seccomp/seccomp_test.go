//go:build linux && amd64

package seccomp

// Installing a filter cannot be undone, so these tests install it in a child:
// the test binary runs itself again with -test.run=^TestHelperProcess$ and
// CAGE_SECCOMP_HELPER set to a mode; the child installs the filter, runs the
// probes of probes_test.go and prints their outcomes as one JSON line; the
// parent asserts. Nothing here needs root: no_new_privs lets any process
// install a filter.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

const (
	helperEnv    = "CAGE_SECCOMP_HELPER" // the child's mode
	fileEnv      = "CAGE_SECCOMP_FILE"   // a file the child reads
	int80Env     = "CAGE_SECCOMP_INT80"  // "1": the child may execute int $0x80
	benchEnv     = "CAGE_SECCOMP_N"      // iterations for the benchmark child
	resultPrefix = "CAGE-SECCOMP-RESULT "
	fileContent  = "cage seccomp probe file\n"
	markerErrno  = unix.EHWPOISON
)

// Child modes.
const (
	modeReal       = "real"       // Install(), then the probes
	modeMarker     = "marker"     // the filter with EHWPOISON for EPERM, then the probes
	modeInt80      = "int80"      // no filter: does int $0x80 work here at all?
	modeBench      = "bench"      // time getpid without a filter
	modeBenchInstd = "bench-filt" // time getpid under Install()
)

// TestHelperProcess is the child's entry point; run directly, it does nothing.
func TestHelperProcess(t *testing.T) {
	mode := os.Getenv(helperEnv)
	if mode == "" {
		t.Skip("helper process for the tests that install the filter")
	}
	result := map[string]outcome{}
	switch mode {
	case modeReal, modeMarker:
		ps := probes(os.Getenv(int80Env) == "1")
		var err error
		if mode == modeReal {
			err = Install()
		} else {
			var prog []unix.SockFilter
			if prog, err = program(markerErrno); err == nil {
				err = install(prog)
			}
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "install:", err)
			os.Exit(3)
		}
		for _, p := range ps {
			result[p.name] = p.fn()
		}
	case modeInt80:
		result["int80"] = outcome{Ret: int64(int80getpid())}
		result["getpid"] = outcome{Ret: int64(os.Getpid())}
	case modeBench, modeBenchInstd:
		if mode == modeBenchInstd {
			if err := Install(); err != nil {
				fmt.Fprintln(os.Stderr, "install:", err)
				os.Exit(3)
			}
		}
		n, _ := strconv.Atoi(os.Getenv(benchEnv))
		start := time.Now()
		for range n {
			unix.RawSyscall(unix.SYS_GETPID, 0, 0, 0)
		}
		result["ns"] = outcome{Ret: time.Since(start).Nanoseconds()}
	default:
		fmt.Fprintln(os.Stderr, "unknown mode", mode)
		os.Exit(3)
	}
	b, _ := json.Marshal(result)
	fmt.Printf("\n%s%s\n", resultPrefix, b)
	os.Exit(0)
}

// runChild runs the test binary as a helper in mode and returns its results.
func runChild(mode string, env ...string) (map[string]outcome, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), append(env, helperEnv+"="+mode)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var result map[string]outcome
	sc := bufio.NewScanner(&stdout)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if line, ok := strings.CutPrefix(sc.Text(), resultPrefix); ok {
			if jerr := json.Unmarshal([]byte(line), &result); jerr != nil {
				return nil, jerr
			}
		}
	}
	if err != nil || result == nil {
		return nil, fmt.Errorf("child %s: %v\nstdout:\n%s\nstderr:\n%s", mode, err, stdout.Bytes(), stderr.Bytes())
	}
	return result, nil
}

var int80Once = sync.OnceValue(func() bool {
	res, err := runChild(modeInt80)
	return err == nil && res["int80"].Ret == res["getpid"].Ret && res["getpid"].Ret > 0
})

// int80Works reports whether this kernel runs i386 syscalls from 64-bit
// processes (CONFIG_IA32_EMULATION, not disabled with ia32_emulation=0).
// Where it does not, int $0x80 raises SIGSEGV, which would kill the child.
func int80Works(t *testing.T) bool {
	ok := int80Once()
	if !ok {
		t.Log("int $0x80 does not work on this kernel, even without a filter; the i386 probe is skipped (TestArchAndX32 still covers it)")
	}
	return ok
}

func TestFilterInChild(t *testing.T) {
	file := filepath.Join(t.TempDir(), "probe")
	if err := os.WriteFile(file, []byte(fileContent), 0o644); err != nil {
		t.Fatal(err)
	}
	env := []string{fileEnv + "=" + file}
	int80 := int80Works(t)
	if int80 {
		env = append(env, int80Env+"=1")
	}
	_, pidfdErr := unix.PidfdOpen(os.Getpid(), 0)

	for _, tc := range []struct {
		mode  string
		errno unix.Errno
	}{
		{modeReal, unix.EPERM},
		{modeMarker, markerErrno},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			res, err := runChild(tc.mode, env...)
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range probes(int80) {
				if p.name == "exec uses pidfd" && pidfdErr != nil {
					t.Logf("skipping %q: no pidfd_open here even without a filter (%v)", p.name, pidfdErr)
					continue
				}
				o, ok := res[p.name]
				if !ok {
					t.Errorf("%s: no result", p.name)
					continue
				}
				got := fmt.Sprintf("ret=%d errno=%d (%v) %s", o.Ret, o.Errno, unix.Errno(o.Errno), o.Err)
				switch p.want {
				case wantOK:
					if o.Errno != 0 || o.Err != "" {
						t.Errorf("%s: want success, got %s", p.name, got)
					}
				case wantDenied:
					if unix.Errno(o.Errno) != tc.errno || o.Err != "" {
						t.Errorf("%s: want %v, got %s", p.name, tc.errno, got)
					}
				case wantENOSYS:
					if unix.Errno(o.Errno) != unix.ENOSYS || o.Err != "" {
						t.Errorf("%s: want ENOSYS, got %s", p.name, got)
					}
				case wantEINVAL:
					if unix.Errno(o.Errno) != unix.EINVAL || o.Err != "" {
						t.Errorf("%s: want EINVAL, got %s", p.name, got)
					}
				case wantNotDenied:
					if unix.Errno(o.Errno) == tc.errno || o.Err != "" {
						t.Errorf("%s: want anything but %v, got %s", p.name, tc.errno, got)
					}
				}
				if testing.Verbose() {
					t.Logf("%-45s %s", p.name, got)
				}
			}
		})
	}
}

// BenchmarkGetpid times a raw getpid in a child without and with the filter.
// The time reported (ns/op) is the child's loop only, not its start-up.
func BenchmarkGetpid(b *testing.B) {
	for _, mode := range []string{modeBench, modeBenchInstd} {
		name := "unfiltered"
		if mode == modeBenchInstd {
			name = "filtered"
		}
		b.Run(name, func(b *testing.B) {
			res, err := runChild(mode, benchEnv+"="+strconv.Itoa(b.N))
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(res["ns"].Ret)/float64(b.N), "ns/op")
		})
	}
}
