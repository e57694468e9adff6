package oci

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/wall/channel"
	"github.com/cagehq/cage/internal/wall/oci/container"
)

// Under gVisor the host cannot pass the agent a listening socket, and must
// not dial one in a directory the sandbox can write: root inside (gVisor
// has no user namespace) could leave a symlink to any host socket there, or
// a socket of its own that learns every client's token. So the host
// listens (package channel) on chanDir/container.Socket in the sandbox's state
// directory, which the container sees read-only at sockInside, and the
// agent connects out. The socket is the agent's uid's, 0600: gVisor serves
// host ids as they are, so no command (root inside has no
// CAP_DAC_OVERRIDE) can connect to it. The channel's key is kept in the state directory,
// which no sandbox sees, for the daemon that adopts the sandbox.
const (
	chanDir = "chan"
	keyFile = "channel.key"
)

// listenChannel makes the channel's directory, key and listening socket.
func (sb *Sandbox) listenChannel() ([]byte, error) {
	key, err := channel.NewKey()
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(sb.dir, keyFile), os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	_, err = f.Write(key)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(sb.dir, chanDir)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, err
	}
	if sb.ch, err = channel.Listen(filepath.Join(dir, container.Socket), key, inside.AgentUID); err != nil {
		return nil, err
	}
	return key, nil
}

// adoptChannel listens again on an adopted sandbox's channel, with the key
// its creator kept: the agent connects to the new socket by itself.
func (sb *Sandbox) adoptChannel() error {
	f, err := os.OpenFile(filepath.Join(sb.dir, keyFile), os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("channel key: %w", err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Uid != 0 || st.Size != channel.KeyBytes {
		return fmt.Errorf("channel key: not a root-owned file of %d bytes", channel.KeyBytes)
	}
	key := make([]byte, channel.KeyBytes)
	if _, err := io.ReadFull(f, key); err != nil {
		return fmt.Errorf("channel key: %w", err)
	}
	sb.ch, err = channel.Listen(filepath.Join(sb.dir, chanDir, container.Socket), key, inside.AgentUID)
	return err
}
