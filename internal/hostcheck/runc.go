package hostcheck

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// runc's advisories of November 2025, fixed in runc 1.2.8, 1.3.3 and
// 1.4.0-rc.3 (1.1 and older were not patched upstream; a distribution
// may carry the fixes in its own build, and then names them in its
// changelog).
var runcCVEs = []string{"CVE-2025-31133", "CVE-2025-52565", "CVE-2025-52881"}

// runcLayout is why cage's runc sandboxes do not need those fixes (see
// docs/SECURITY.md, "runc's November 2025 advisories").
const runcLayout = "cage's bundles leave them nothing to race (no console, no runc exec, a root and /dev of each sandbox's own, " +
	"volume mount points made without symlinks, a user namespace whose root is no host user): see docs/SECURITY.md"

// Debian's record of its packages: which files runc's package installed,
// and its changelog.
var (
	dpkgList        = "/var/lib/dpkg/info/runc.list"
	debianChangelog = "/usr/share/doc/runc/changelog.Debian.gz"
)

// Runc says which runc the runc wall runs and whether it is known to
// carry the fixes of runcCVEs: by its version, or, for a build of
// Debian's package, by the CVEs its changelog names. It never fails the
// check: cage's layout does not rely on them. ok is false when there is
// no runc.
func Runc() (c Check, ok bool) {
	path, err := exec.LookPath("runc")
	if err != nil {
		return Check{}, false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, path, "--version").Output()
	if err != nil {
		return Check{"runc", true, fmt.Sprintf("%s: `runc --version` failed (%v); %s", path, err, runcLayout)}, true
	}
	var changelog []byte
	if debianRunc(path) {
		changelog = readGzip(debianChangelog, 4<<20)
	}
	return runcCheck(path, string(out), changelog), true
}

// runcCheck reads `runc --version`'s output and, for Debian's build, the
// package's changelog (nil otherwise).
func runcCheck(path, version string, changelog []byte) Check {
	ver, commit := "", ""
	for _, line := range strings.Split(version, "\n") {
		if v, ok := strings.CutPrefix(line, "runc version "); ok {
			ver = strings.TrimSpace(v)
		} else if v, ok := strings.CutPrefix(line, "commit: "); ok {
			commit = strings.TrimSpace(v)
		}
	}
	if ver == "" {
		return Check{"runc", true, fmt.Sprintf("%s: version unknown (%.60q); %s", path, strings.TrimSpace(version), runcLayout)}
	}
	what := "runc " + ver
	if changelog != nil && commit != "" {
		what += " (Debian " + commit + ")"
	}
	if runcFixedVersion(ver) {
		return Check{"runc", true, fmt.Sprintf("%s: carries the fixes for %s (runc 1.2.8, 1.3.3, 1.4.0)", what, strings.Join(runcCVEs, ", "))}
	}
	var named, missing []string
	for _, cve := range runcCVEs {
		if changelog != nil && bytes.Contains(changelog, []byte(cve)) {
			named = append(named, cve)
		} else {
			missing = append(missing, cve)
		}
	}
	if len(missing) == 0 {
		return Check{"runc", true, fmt.Sprintf("%s: its changelog names the fixes for %s", what, strings.Join(named, ", "))}
	}
	where := "an upstream build before 1.2.8 carries none of them"
	if changelog != nil {
		where = "the package's changelog names " + ifElse(len(named) == 0, "none of them", strings.Join(named, ", ")+" only")
	}
	return Check{"runc", true, fmt.Sprintf("%s: not known to carry the fixes for %s (runc 1.2.8, 1.3.3, 1.4.0; %s); %s",
		what, strings.Join(missing, ", "), where, runcLayout)}
}

var runcVersionRE = regexp.MustCompile(`^(\d+)\.(\d+)\.(\d+)(?:-rc\.?(\d+))?`)

// runcFixedVersion reports whether an upstream version has the fixes:
// 1.2.8 and later 1.2, 1.3.3 and later 1.3, 1.4.0-rc.3 and later.
func runcFixedVersion(v string) bool {
	m := runcVersionRE.FindStringSubmatch(v)
	if m == nil {
		return false
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	patch, _ := strconv.Atoi(m[3])
	rc := -1 // a release
	if m[4] != "" {
		rc, _ = strconv.Atoi(m[4])
	}
	switch {
	case major != 1:
		return major > 1
	case minor == 2:
		return patch >= 8 && rc < 0
	case minor == 3:
		return patch >= 3 && rc < 0
	case minor == 4 && patch == 0:
		return rc < 0 || rc >= 3
	}
	return minor >= 4
}

// debianRunc reports whether path is the runc Debian's package installed.
func debianRunc(path string) bool {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return false
	}
	f, err := os.Open(dpkgList)
	if err != nil {
		return false
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if l := s.Text(); l == path || l == real {
			return true
		}
	}
	return false
}

// readGzip reads a gzipped file, at most limit bytes of it; nil when it
// cannot.
func readGzip(path string, limit int64) []byte {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	z, err := gzip.NewReader(f)
	if err != nil {
		return nil
	}
	b, err := io.ReadAll(io.LimitReader(z, limit))
	if err != nil {
		return nil
	}
	return b
}
