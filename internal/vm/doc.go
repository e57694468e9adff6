// Package vm is the groundwork of the microVM wall: a sandbox that is a small
// virtual machine run by QEMU, so that the guest kernel, not the host's, is
// what untrusted code talks to.
//
// The pieces, host side first:
//
//   - The guest kernel is Debian's cloud kernel, unpacked (not installed) by
//     scripts/kernel.sh; FindKernel locates it. It is small, boots under
//     QEMU's microvm machine, and has the virtio drivers as modules, so the
//     initramfs must carry and load them.
//   - WriteInitramfs writes the guest's whole root: an uncompressed newc cpio
//     with /init (the static agent), the modules asked for and everything they
//     depend on, and /modules.order, the order to load them in. There is no
//     disk and no userspace besides /init: the VM exists to run the agent.
//     The output depends only on its inputs, so an initramfs can be cached by
//     a key of them.
//   - Start runs qemu-system-x86_64 with the microvm machine (no PCI, no
//     firmware to speak of, virtio-mmio devices described to the guest by
//     ACPI, since Debian's kernel cannot take them from its command line),
//     QEMU's own seccomp sandbox, and one virtio-serial port named "agent"
//     whose host end is a unix socket in the VM's directory (made by the
//     host and handed to QEMU as a listening descriptor, as QMP's is). That
//     port is the only channel between host and guest; the guest's console
//     is QEMU's standard output, of which the host keeps the last 64 KiB in
//     memory (Console). With a Credential, QEMU runs jailed (jail.go): its
//     own network, mount, PID, IPC and UTS namespaces, a read-only root of
//     /usr, a few /dev nodes and its own /proc, its uid, no_new_privs.
//   - Snapshot and Restore (snapshot.go) save a VM whose RAM is a shared
//     file and start others from it, the file mapped private, over QMP
//     (qmp.go, a small client of QEMU's machine protocol).
//
// Guest side, boot.GuestSetup is what the agent calls first when it runs as PID 1
// inside the VM: it mounts /dev, /proc and /sys, loads the modules in the
// order WriteInitramfs recorded, and opens the agent port.
//
// KVM is used only where it boots a guest: ProbeKVM tries, because a
// /dev/kvm that exists (a nested hypervisor, say) is no proof that it runs
// this kernel. Otherwise QEMU emulates the CPU (TCG), which is slower but
// the same wall.
package vm
