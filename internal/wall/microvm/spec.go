// Package microvm is the microvm wall in the making: a QEMU microvm per
// sandbox, with its own guest kernel, the agent as the guest's init. Not a
// wall of sandbox.Host yet (the conformance suite does not pass on it):
// today it boots a VM from an image template and serves the agent's
// protocol from inside it.
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
package microvm

// spec is what the host sends on the session's first stream.
type spec struct {
	Token     string            `json:"token"`
	Env       map[string]string `json:"env"`
	MaxOutput int64             `json:"max_output"`
	Hostname  string            `json:"hostname"`
	DiskBytes int64             `json:"disk_bytes"`
	Threads   int               `json:"threads"`
}

// hello is what the guest writes on the port before the session starts:
// a write blocks until the host has connected, so the session never reads
// the EOF of a port nobody holds yet.
const hello = "cage-agent\n"

// ready is the guest's answer on the spec stream once it serves.
const ready = "ready\n"
