package vm

import (
	"bufio"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cagehq/cage/internal/vm/boot"
)

// Kernel is a guest kernel unpacked from Debian's package: its image and its
// modules.
type Kernel struct {
	Version string // e.g. 6.1.0-57-cloud-amd64
	Vmlinuz string // the bootable image, boot/vmlinuz-VERSION
	Vmlinux string // the same kernel uncompressed, boot/vmlinux-VERSION ("" when absent)
	Modules string // the modules' directory, lib/modules/VERSION
	Config  string // the kernel's build configuration, boot/config-VERSION ("" when absent)
}

// DefaultModules are the drivers the wall's guest needs: the virtio-mmio
// transport (microvm has no PCI), the disk, the agent's port and the network.
// In Debian's 6.1 cloud kernel all four are modules (so are virtio and
// virtio_ring, which they need); ResolveModules skips any a kernel has built
// in, so a kernel with some of them built in still works.
var DefaultModules = []string{"virtio_mmio", "virtio_blk", "virtio_console", "virtio_net"}

// FindKernel finds the kernel in dir: either a directory scripts/kernel.sh
// filled (its "current" link is followed) or one unpacked kernel package.
func FindKernel(dir string) (*Kernel, error) {
	root := dir
	if fi, err := os.Stat(filepath.Join(dir, "current")); err == nil && fi.IsDir() {
		root = filepath.Join(dir, "current")
	}
	images, _ := filepath.Glob(filepath.Join(root, "boot", "vmlinuz-*"))
	var found []*Kernel
	for _, img := range images {
		ver := strings.TrimPrefix(filepath.Base(img), "vmlinuz-")
		mods := filepath.Join(root, "lib", "modules", ver)
		if fi, err := os.Stat(mods); err != nil || !fi.IsDir() {
			continue
		}
		k := &Kernel{Version: ver, Vmlinuz: img, Modules: mods}
		if raw := filepath.Join(root, "boot", "vmlinux-"+ver); isELF(raw) {
			k.Vmlinux = raw
		}
		if cfg := filepath.Join(root, "boot", "config-"+ver); fileExists(cfg) {
			k.Config = cfg
		}
		found = append(found, k)
	}
	switch len(found) {
	case 0:
		return nil, fmt.Errorf("no guest kernel in %s (boot/vmlinuz-VERSION with lib/modules/VERSION); run scripts/kernel.sh", dir)
	case 1:
		return found[0], nil
	}
	var vers []string
	for _, k := range found {
		vers = append(vers, k.Version)
	}
	return nil, fmt.Errorf("several guest kernels in %s (%s); point at one of them", dir, strings.Join(vers, ", "))
}

// Image is what QEMU boots: the uncompressed kernel when there is one, else
// the compressed one.
//
// QEMU boots an uncompressed kernel (an ELF file with a PVH entry point, as
// Debian's has) directly, skipping the kernel's own decompression, which
// takes most of a second under TCG. The price is that the kernel stays at
// the address it was linked for: KASLR is the decompressor's work. Guests
// restored from one snapshot share one layout anyway.
func (k *Kernel) Image() string {
	if k.Vmlinux != "" {
		return k.Vmlinux
	}
	return k.Vmlinuz
}

// isELF says whether p is an ELF file.
func isELF(p string) bool {
	f, err := os.Open(p)
	if err != nil {
		return false
	}
	defer f.Close()
	magic := make([]byte, 4)
	_, err = io.ReadFull(f, magic)
	return err == nil && string(magic) == elf.ELFMAG
}

// module is one loadable module of a kernel.
type module struct {
	path string   // relative to the modules' directory
	deps []string // names of the modules it needs
}

// modName is the name the kernel knows a module file by: the file name
// without its extensions, with dashes as underscores (the kernel treats
// them as the same).
func modName(path string) string {
	base := filepath.Base(path)
	if i := strings.Index(base, ".ko"); i >= 0 {
		base = base[:i]
	}
	return strings.ReplaceAll(base, "-", "_")
}

// modules reads the kernel's loadable modules and their dependencies. It
// reads modules.dep (what depmod writes; scripts/kernel.sh runs it), and
// where that is missing, as in a bare unpacked Debian package, the
// dependency list each module carries in its .modinfo section, which is
// what depmod reads too.
func (k *Kernel) modules() (map[string]module, error) {
	mods, err := readModulesDep(k.Modules)
	if errors.Is(err, fs.ErrNotExist) {
		return readModinfoDeps(k.Modules)
	}
	return mods, err
}

func readModulesDep(dir string) (map[string]module, error) {
	f, err := os.Open(filepath.Join(dir, "modules.dep"))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	mods := map[string]module{}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		path, rest, ok := strings.Cut(line, ":")
		if !ok {
			return nil, fmt.Errorf("%s: malformed line %q", f.Name(), line)
		}
		m := module{path: path}
		for _, d := range strings.Fields(rest) {
			m.deps = append(m.deps, modName(d))
		}
		mods[modName(path)] = m
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", f.Name(), err)
	}
	return mods, nil
}

func readModinfoDeps(dir string) (map[string]module, error) {
	mods := map[string]module{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || !strings.Contains(d.Name(), ".ko") {
			return nil
		}
		rel, _ := filepath.Rel(dir, p)
		m := module{path: filepath.ToSlash(rel)}
		if c := boot.Compression(p); c != "" {
			return fmt.Errorf("no modules.dep, and the modules are compressed (%s); run depmod (scripts/kernel.sh does)", c)
		}
		deps, err := modinfoDepends(p)
		if err != nil {
			return err
		}
		m.deps = deps
		mods[modName(p)] = m
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read modules of %s: %w", dir, err)
	}
	return mods, nil
}

// modinfoDepends reads the "depends=" entry of a module's .modinfo section
// (NUL-separated key=value strings).
func modinfoDepends(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, fmt.Errorf("%s: no .modinfo section", path)
	}
	data, err := sec.Data()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	var deps []string
	for _, kv := range strings.Split(string(data), "\x00") {
		if v, ok := strings.CutPrefix(kv, "depends="); ok {
			for _, d := range strings.Split(v, ",") {
				if d != "" {
					deps = append(deps, strings.ReplaceAll(d, "-", "_"))
				}
			}
		}
	}
	return deps, nil
}

// builtins reads modules.builtin: the modules compiled into the kernel.
func (k *Kernel) builtins() (map[string]bool, error) {
	data, err := os.ReadFile(filepath.Join(k.Modules, "modules.builtin"))
	if errors.Is(err, fs.ErrNotExist) {
		return map[string]bool{}, nil
	}
	if err != nil {
		return nil, err
	}
	b := map[string]bool{}
	for _, line := range strings.Fields(string(data)) {
		b[modName(line)] = true
	}
	return b, nil
}

// ResolveModules turns module names into the module files to load, with
// every dependency, in an order in which each comes after all it depends on
// (paths relative to k.Modules). Names the kernel has built in are returned
// apart, in builtin, and need no loading.
func (k *Kernel) ResolveModules(names []string) (paths, builtin []string, err error) {
	mods, err := k.modules()
	if err != nil {
		return nil, nil, err
	}
	built, err := k.builtins()
	if err != nil {
		return nil, nil, err
	}
	const (
		visiting = 1
		done     = 2
	)
	state := map[string]int{}
	var visit func(name, from string) error
	visit = func(name, from string) error {
		switch state[name] {
		case done:
			return nil
		case visiting:
			return fmt.Errorf("kernel %s: modules depend on each other in a cycle through %s", k.Version, name)
		}
		m, ok := mods[name]
		if !ok {
			if from != "" {
				return fmt.Errorf("kernel %s: module %s needs %s, which is not among its modules", k.Version, from, name)
			}
			return fmt.Errorf("kernel %s has no module %s (neither loadable nor built in)", k.Version, name)
		}
		state[name] = visiting
		// Dependencies in name order, so the result does not depend on how
		// modules.dep happens to list them.
		deps := slices.Clone(m.deps)
		slices.Sort(deps)
		for _, d := range deps {
			if built[d] {
				continue
			}
			if err := visit(d, name); err != nil {
				return err
			}
		}
		state[name] = done
		paths = append(paths, m.path)
		return nil
	}
	for _, n := range names {
		name := strings.ReplaceAll(n, "-", "_")
		if built[name] {
			if !slices.Contains(builtin, name) {
				builtin = append(builtin, name)
			}
			continue
		}
		if err := visit(name, ""); err != nil {
			return nil, nil, err
		}
	}
	return paths, builtin, nil
}

// canLoadCompressed says whether the kernel decompresses modules itself
// (finit_module with MODULE_INIT_COMPRESSED_FILE), which needs
// CONFIG_MODULE_DECOMPRESS and the one algorithm the kernel was built with.
func (k *Kernel) canLoadCompressed(c string) (bool, error) {
	if k.Config == "" {
		return false, nil
	}
	data, err := os.ReadFile(k.Config)
	if err != nil {
		return false, err
	}
	cfg := map[string]bool{}
	for _, line := range strings.Split(string(data), "\n") {
		if name, ok := strings.CutSuffix(line, "=y"); ok {
			cfg[name] = true
		}
	}
	alg := map[string]string{"xz": "XZ", "zst": "ZSTD", "gz": "GZIP"}[c]
	return cfg["CONFIG_MODULE_DECOMPRESS"] && cfg["CONFIG_MODULE_COMPRESS_"+alg], nil
}

func fileExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}
