// Package microvm is the microvm wall: a QEMU microvm per sandbox, with its
// own guest kernel. cage-agent is the guest's init, which starts the agent
// (cage-agent guest) as PID 1 of the sandbox's own PID namespace and then
// only reaps (guestinit.go).
//
// The guest reaches the host over one virtio-serial port (no vhost-vsock on
// these hosts). The host connects to the port's socket, the guest says
// hello, and the two run a yamux session over it: the host's first stream
// carries the spec (token, environment, hostname, sizes) and the guest's
// answer, every later stream is one connection to the agent, which is what
// the wall's Dial returns.
//
// The root: the template's files as a read-only ext4 image (/dev/vda), built
// once per template from its layers, under an overlay whose upper layer is
// a tmpfs of the sandbox's disk size.
//
// Sandboxes start from snapshots: the first Create of a VM shape (kernel,
// initramfs and so agent, template image, memory, CPUs) boots a guest,
// has it mount its root, make the agent's server (no token, environment
// or limits yet) and wait for a host again, and saves it (snapshot.go);
// every Create restores a VM from that snapshot, its RAM the snapshot's
// file mapped copy-on-write, and sends the spec, which gives the guest its
// own identity and limits and the agent its token before the agent serves
// (see spec). A VM boots cold only when no snapshot can be made. A pool's
// VM (prepare.go) is restored and greeted ahead of its create, QEMU at
// background priority until the create takes it, which then sends the
// spec; under TCG the pool starts it and runs a command first.
package microvm
