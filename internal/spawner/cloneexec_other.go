//go:build !amd64

package spawner

import "syscall"

// CloneExec is syscall.ForkExec where rawClone3 is not written (see
// cloneexec_amd64.go).
func CloneExec(path string, argv []string, attr *syscall.ProcAttr) (int, error) {
	return syscall.ForkExec(path, argv, attr)
}
