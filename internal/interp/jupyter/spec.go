package jupyter

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Spec is a kernelspec: how to launch a kernel (its kernel.json).
type Spec struct {
	Name        string            `json:"-"`
	Dir         string            `json:"-"` // the kernelspec's directory ({resource_dir})
	Argv        []string          `json:"argv"`
	DisplayName string            `json:"display_name"`
	Language    string            `json:"language"`
	Env         map[string]string `json:"env"`
	// InterruptMode is "signal" (SIGINT to the kernel, the default) or
	// "message" (interrupt_request on the control channel).
	InterruptMode string `json:"interrupt_mode"`
}

// ErrNoSpec is returned when no kernelspec of a name is installed.
var ErrNoSpec = errors.New("no such kernel")

// SpecDirs are the directories kernelspecs are looked for in, as Jupyter
// looks: $JUPYTER_PATH, the user's data directory, then the system's.
func SpecDirs() []string {
	var dirs []string
	for _, d := range filepath.SplitList(os.Getenv("JUPYTER_PATH")) {
		if d != "" {
			dirs = append(dirs, filepath.Join(d, "kernels"))
		}
	}
	if home, err := os.UserHomeDir(); err == nil {
		dirs = append(dirs, filepath.Join(home, ".local/share/jupyter/kernels"))
	}
	return append(dirs, "/usr/local/share/jupyter/kernels", "/usr/share/jupyter/kernels")
}

// FindSpec reads the kernelspec called name from the first of dirs that
// has it.
func FindSpec(name string, dirs []string) (*Spec, error) {
	if name == "" || strings.ContainsAny(name, "/\x00") || name == "." || name == ".." {
		return nil, fmt.Errorf("%w: %q", ErrNoSpec, name)
	}
	for _, d := range dirs {
		data, err := os.ReadFile(filepath.Join(d, name, "kernel.json"))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		s := &Spec{Name: name, Dir: filepath.Join(d, name)}
		if err := json.Unmarshal(data, s); err != nil {
			return nil, fmt.Errorf("kernelspec %s: %w", filepath.Join(d, name), err)
		}
		if len(s.Argv) == 0 {
			return nil, fmt.Errorf("kernelspec %s: no argv", filepath.Join(d, name))
		}
		return s, nil
	}
	return nil, fmt.Errorf("%w: %q (looked in %s)", ErrNoSpec, name, strings.Join(dirs, ", "))
}
