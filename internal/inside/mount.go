package inside

// Kind is what a Mount puts at its destination.
type Kind string

const (
	Dir     Kind = "dir"     // a read-only recursive bind of a host directory
	File    Kind = "file"    // a read-only bind of a host file
	Symlink Kind = "symlink" // a symlink with Target
)

// Mount is one entry of a sandbox's root filesystem taken from the host.
type Mount struct {
	Kind   Kind   `json:"kind"`
	Source string `json:"source,omitempty"` // host path (Dir, File)
	Dest   string `json:"dest"`             // path inside the sandbox
	Target string `json:"target,omitempty"` // Symlink target
}
