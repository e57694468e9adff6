// Package guest is the microvm wall's inside half: cage-agent as the guest's
// init and as the sandbox's agent inside the VM. Its host half, package
// microvm, sends it the Spec defined here over the VM's agent port. It
// imports nothing of the host's (see cmd/cage-agent's dependency test).
package guest

import (
	"net/netip"

	"github.com/cagehq/cage/internal/cgroups"
)

// Spec is what the host sends on the session's first stream.
//
// A prepare spec (Prepare set, nothing else but DiskBytes, ShmBytes and
// Threads) is how a snapshot is made: the guest mounts its root, makes the
// agent's server in the sandbox's cgroup (with no token, environment or
// limits: those come with the full spec), answers prepared, and once
// the host has gone it waits for the next host exactly as a fresh guest
// does, by writing hello. The VM is saved there, and every VM restored
// from it greets the host that connects to it and takes the full spec.
//
// Entropy and UnixNano make a restored guest its own: restored guests
// start with the same kernel RNG state and the clock of the moment of the
// snapshot, so the guest mixes the host's random bytes into its RNG and
// sets its clock before the agent serves. A cold-booted guest does the
// same; it costs nothing.
//
// A resume spec (Resume set, with Entropy and UnixNano) is what the host
// sends a guest restored from a checkpoint of a serving sandbox: its
// agent, which saw the host go as the VM was saved, serves the new host
// as it served the old, after the guest's init has set the clock and
// mixed the random bytes in (the agent, sealed, may do neither).
type Spec struct {
	Prepare  bool   `json:"prepare,omitempty"`
	Resume   bool   `json:"resume,omitempty"`
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
	Net *Net `json:"net,omitempty"`
	// Trace has the guest print its phase marks on its console (the
	// host's CAGE_TRACE; see package trace).
	Trace bool `json:"trace,omitempty"`
}

// Net configures the guest's eth0 as the other walls' is in the
// sandbox's namespace: a /32, a route to the gateway, the default route.
type Net struct {
	IP         netip.Addr `json:"ip"`
	Gateway    netip.Addr `json:"gateway"`
	ResolvConf string     `json:"resolv_conf"`
}

// Hello is what the guest writes on the port before the session starts:
// a write blocks until the host has connected, so the session never reads
// the EOF of a port nobody holds yet.
const Hello = "cage-agent\n"

// Ready is the guest's answer on the spec stream once it serves.
const Ready = "ready\n"

// Prepared is the guest's answer to a prepare spec.
const Prepared = "prepared\n"

// EntropyBytes is how many random bytes the host sends with each spec.
const EntropyBytes = 64
