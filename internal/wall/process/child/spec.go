// Package child is the process wall's inside half: cage-agent's steps as
// the sandbox's PID 1, inside the new namespaces, before it serves (read the
// spec, build the root, pivot, seal). Its host half, package process, sends
// it the two documents defined here. It imports nothing of the host's (see
// cmd/cage-agent's dependency test).
package child

import "github.com/cagehq/cage/internal/inside"

// The host sends the child two JSON documents over a pipe. InitSpec, once
// the child is in its cgroups, says how to build the sandbox: the child
// builds it, seals itself and waits. StartSpec, when the sandbox is wanted,
// carries what is particular to one request and needs no privilege; the
// child then serves. A pool keeps sandboxes between the two, sealed.
type InitSpec struct {
	ID       string         `json:"id"`
	Hostname string         `json:"hostname"`
	Root     string         `json:"root"` // host directory the new root is mounted on
	Mounts   []inside.Mount `json:"mounts"`
	// Image, when set, names a writable root the host mounted (an image
	// template's overlay); the child gets a detached copy of it on fdRoot
	// and attaches it instead of building a root from Mounts. The disk is
	// then the host's, under the overlay.
	Image string `json:"image,omitempty"`
	// Build: a template build's sandbox (see template.Template.Build).
	Build bool `json:"build,omitempty"`
	// Volumes are where the volumes the host sends on fdRoot (after the
	// image's root, if any), in order, are mounted.
	Volumes []string `json:"volumes,omitempty"`

	DiskBytes  int64 `json:"disk_bytes"`
	DiskInodes int64 `json:"disk_inodes"`
	ShmBytes   int64 `json:"shm_bytes"`
	// ResolvConf is set when the sandbox has a network.
	ResolvConf string `json:"resolv_conf,omitempty"`

	UserName string `json:"user_name"`
	UserUID  int    `json:"user_uid"`
	UserGID  int    `json:"user_gid"`

	OOMEvents  string `json:"oom_events"`  // host path of the cgroup's OOM counter
	PidsEvents string `json:"pids_events"` // host path of the pids-limit counter
	// WorkloadTasks, when not 0, is the descriptor of the tasks file of
	// the workload's pids group (cgroups.SplitPids): the thread that forks
	// every process moves itself there, and the agent then holds its pids
	// without taking its threads ahead.
	WorkloadTasks int `json:"workload_tasks,omitempty"`

	Debug bool `json:"debug"`
	// DieWithParent re-arms the parent-death signal after the agent changes
	// its uid (which clears it).
	DieWithParent bool `json:"die_with_parent"`
	// Run, when set, is the one command the sandbox is made for (cage
	// run): the agent starts it once sealed and started, and serves
	// nothing.
	Run *RunSpec `json:"run,omitempty"`
}

// RunSpec is a one-shot sandbox's command. Its pipes are the child's
// descriptors FD to FD+4: stdin, stdout, stderr, the host's control pipe
// (signals) and the status pipe (how the command ended).
type RunSpec struct {
	Cmd  string            `json:"cmd"`
	Args []string          `json:"args,omitempty"`
	Cwd  string            `json:"cwd,omitempty"`
	User string            `json:"user,omitempty"`
	Env  map[string]string `json:"env,omitempty"`
	FD   int               `json:"fd"`
}

// StartSpec is the second document: one request's own settings. Its disk
// and shm sizes are InitSpec's (the sealed child can no longer remount: a
// pool hands a member only to creates of its sizes); the child refuses
// others.
type StartSpec struct {
	Token      string            `json:"token"`
	Env        map[string]string `json:"env"`
	MaxOutput  int64             `json:"max_output"`
	DiskBytes  int64             `json:"disk_bytes"`
	DiskInodes int64             `json:"disk_inodes"`
	ShmBytes   int64             `json:"shm_bytes"`
}

// Descriptors the child inherits.
const (
	fdSpec     = 3 // read end of the spec pipe
	fdListener = 4 // the agent's listening socket
	fdIDLock   = 5 // the sandbox's uid-range lock, held for as long as the agent lives
	fdRoot     = 6 // image templates, volumes: a socket the host sends the root's and volumes' mounts on
)

// The sandbox's own user, as the template's accounts define it.
const (
	userName = inside.UserName
	userUID  = inside.UserUID
	agentUID = inside.AgentUID
)
