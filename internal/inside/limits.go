package inside

// AgentThreads is how many threads the agent holds (it takes them before it
// serves); the pids limit is raised by as much, so that the workload's
// budget is what was asked.
const AgentThreads = 20

// InodesFor sizes the disk's inode table: one per 8 KiB, at least 4096.
func InodesFor(bytes int64) int64 { return max(4096, bytes/8192) }
