// Package process is cage's embedded default wall: a sandbox made of Linux
// namespaces (user, PID, mount, IPC, UTS, cgroup, network), a pivot_root into
// a root assembled from a template, cgroup limits, dropped capabilities,
// no_new_privs, Landlock and a seccomp filter — pure Go, no external binary.
//
// This package is the host's half, run by cage as host root; the inside
// half is package child, run by cage-agent as the sandbox's PID 1 inside
// the new namespaces before it serves. Setup reads top to bottom:
//
//	host   sandbox.go         uid range, state directory, cgroups and limits,
//	                          the agent's listening socket, fork into the
//	                          namespaces with the id maps, the two spec documents
//	child  child/spec.go      the documents the host sends
//	child  child/init.go      read the spec, own cgroup namespace, limit counters,
//	                          the steps below in order, then seal
//	child  child/mounts.go    root (template binds or the image's overlay), disk,
//	                          pivot_root
//	child  inside/dev.go      minimal /dev
//	child  inside/mounts.go   /proc and its masks
//	child  child/etc.go       identity files (/run/cage)
//	child  inside/net.go      loopback up
//	child  seal               spawning thread's bounding set and securebits,
//	                          Landlock, the agent's uid and capabilities,
//	                          no_new_privs, seccomp (internal/seccomp)
//	host   adopt.go           take charge of a sandbox another process made
//
// The host reaches the agent through a unix socket that the host creates and
// passes in as a listening descriptor; nothing of it is visible inside the
// sandbox's filesystem.
package process
