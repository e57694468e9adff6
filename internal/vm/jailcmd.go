package vm

import (
	"encoding/json"
	"os"
	"os/exec"
	"syscall"

	"github.com/cagehq/cage/internal/vm/jail"
)

// jailCommand is the command that runs QEMU (bin, args) jailed as cred,
// with files as its descriptors 3 and up, and the read end of a lifeline
// after them; no regular file it writes grows past fileBytes. The caller
// closes lifeR once the command has started, and holds lifeW for as long
// as QEMU may run.
func jailCommand(jailer, bin string, args []string, cred *syscall.Credential, kvm bool, fileBytes int64, files []*os.File) (cmd *exec.Cmd, lifeR, lifeW *os.File, err error) {
	if lifeR, lifeW, err = os.Pipe(); err != nil {
		return nil, nil, nil, err
	}
	spec, err := json.Marshal(jail.Spec{UID: cred.Uid, GID: cred.Gid, Groups: cred.Groups, KVM: kvm,
		Lifeline: 3 + len(files), FileBytes: fileBytes})
	if err != nil {
		lifeR.Close()
		lifeW.Close()
		return nil, nil, nil, err
	}
	cmd = exec.Command(jailer, append([]string{jail.Arg, string(spec), bin}, args...)...)
	cmd.Args[0] = "cage-agent"
	cmd.Dir = "/"
	cmd.Env = []string{}
	cmd.ExtraFiles = append(append([]*os.File{}, files...), lifeR)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Cloneflags: jail.Flags}
	return cmd, lifeR, lifeW, nil
}
