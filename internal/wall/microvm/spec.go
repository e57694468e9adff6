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
// has it mount its root and wait for a host again, and saves it
// (snapshot.go); every Create restores a VM from that snapshot, its RAM
// the snapshot's file mapped copy-on-write, and sends the spec, which
// gives the guest its own identity before the agent exists (see spec).
// A VM boots cold only when no snapshot can be made.
package microvm

import (
	"net/netip"

	"github.com/cagehq/cage/internal/cgroups"
)

// spec is what the host sends on the session's first stream.
//
// A prepare spec (Prepare set, nothing else but DiskBytes) is how a
// snapshot is made: the guest mounts its root, answers prepared, and once
// the host has gone it waits for the next host exactly as a fresh guest
// does, by writing hello. The VM is saved there, and every VM restored
// from it greets the host that connects to it and takes the full spec.
//
// Entropy and UnixNano make a restored guest its own: restored guests
// start with the same kernel RNG state and the clock of the moment of the
// snapshot, so the guest mixes the host's random bytes into its RNG and
// sets its clock before the agent exists. A cold-booted guest does the
// same; it costs nothing.
type spec struct {
	Prepare  bool   `json:"prepare,omitempty"`
	Entropy  []byte `json:"entropy,omitempty"`
	UnixNano int64  `json:"unix_nano,omitempty"`

	Token     string            `json:"token"`
	Env       map[string]string `json:"env"`
	MaxOutput int64             `json:"max_output"`
	Hostname  string            `json:"hostname"`
	DiskBytes int64             `json:"disk_bytes"`
	ShmBytes  int64             `json:"shm_bytes"`
	Threads   int               `json:"threads"`
	// Limits go to the guest's cgroup of the sandbox (see guestCgroup).
	Limits cgroups.Limits `json:"limits"`
	// Net, when set, is the guest's network: its NIC's address, the
	// gateway, the resolver's configuration.
	Net *guestNet `json:"net,omitempty"`
}

// guestNet configures the guest's eth0 as the other walls' is in the
// sandbox's namespace: a /32, a route to the gateway, the default route.
type guestNet struct {
	IP         netip.Addr `json:"ip"`
	Gateway    netip.Addr `json:"gateway"`
	ResolvConf string     `json:"resolv_conf"`
}

// hello is what the guest writes on the port before the session starts:
// a write blocks until the host has connected, so the session never reads
// the EOF of a port nobody holds yet.
const hello = "cage-agent\n"

// ready is the guest's answer on the spec stream once it serves.
const ready = "ready\n"

// prepared is the guest's answer to a prepare spec.
const prepared = "prepared\n"

// entropyBytes is how many random bytes the host sends with each spec.
const entropyBytes = 64
