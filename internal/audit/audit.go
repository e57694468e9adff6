// Package audit is cage's audit trail: an append-only, hash-chained log of
// who did what in which sandbox, kept in a SQLite database of its own
// (DATA/audit.db, beside cage.db and records.db).
//
// Every entry carries the SHA-256 of the entry before it (its prev) and its
// own hash over prev and every field it stores, so an entry changed,
// deleted or moved anywhere breaks the chain at that entry (Verify). Entries
// are numbered 1, 2, 3, ... without gaps. Retention deletes the oldest
// entries only (a prefix of the chain), and appends an anchor entry that
// names the last entry deleted and its hash, so the chain that remains still
// verifies from its first entry; removing entries without an anchor is a
// break. What the chain cannot show is a rewrite of the whole chain by
// someone with root on the host: export the head (Head) to anchor it
// outside, and check it later (Verify with a Checkpoint).
//
// What is recorded, and who observes it (Source): the daemon's API calls
// and lifecycle (host), the envd requests its proxy forwards: processes
// started, files written and removed (host: the request itself, the bytes
// hashed as they pass), and what only the sandbox's agent tells the host:
// a process's pid and how it ended (agent), network decisions (host: the
// kernel's log and cage's resolver), API key changes made with `cage keys`
// (cli).
//
// Writing never waits on the database: Trail.Record queues an entry (a
// bounded queue) and one goroutine writes the queue in batches, one
// transaction each. What a sandbox or a key may fill the trail with is
// bounded (Limits); entries not kept are counted, and the counts are
// entries of the chain themselves (audit.capped, audit.dropped).
package audit

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash"
	"io"
	"strconv"
	"strings"
	"time"
)

// Sources: who observed what an entry says.
const (
	// SourceHost: the daemon saw it itself (a request it served or
	// forwarded, bytes it hashed, a cgroup counter, the kernel's log).
	SourceHost = "host"
	// SourceAgent: the sandbox's agent told the host (a process's pid,
	// its exit code and reason). The agent runs inside the sandbox and may
	// lie; the entry says only what it reported.
	SourceAgent = "agent"
	// SourceCLI: a `cage` command run on the host (API key changes).
	SourceCLI = "cli"
)

// Kinds of entries. A kind is a family and an action: filters match a
// family ("process") or a kind ("process.start").
const (
	KindAPICall     = "api.call"
	KindProxyDenied = "proxy.denied"

	KindCreate   = "sandbox.create"
	KindPause    = "sandbox.pause"
	KindResume   = "sandbox.resume"
	KindSnapshot = "sandbox.snapshot"
	KindFork     = "sandbox.fork"
	KindKill     = "sandbox.kill"
	KindTimeout  = "sandbox.timeout"
	KindDied     = "sandbox.died"
	KindOOM      = "sandbox.oom"
	KindPidsMax  = "sandbox.pids_limit"
	KindAdopt    = "sandbox.adopt"
	KindRemoved  = "sandbox.removed"
	KindNetwork  = "sandbox.network"
	// KindCheckpoint: a checkpointed sandbox's checkpoint could not be
	// used (it resumes from its files).
	KindCheckpoint = "sandbox.checkpoint"

	KindProcessStart  = "process.start"
	KindProcessEnd    = "process.end"
	KindProcessSignal = "process.signal"
	KindCodeRun       = "process.code"

	KindFileWrite = "file.write"
	KindFileRead  = "file.read"
	KindFileRm    = "file.remove"
	KindFileMove  = "file.move"
	KindFileMkdir = "file.mkdir"
	KindEnvdCall  = "envd.call"

	KindNetConnect = "net.connect"
	KindNetDNS     = "net.dns"

	KindVolumeCreate = "volume.create"
	KindVolumeDelete = "volume.delete"

	KindKeyCreate = "key.create"
	KindKeyRevoke = "key.revoke"

	KindTeamCreate = "team.create"
	KindTeamUpdate = "team.update"
	KindTeamDelete = "team.delete"

	KindAnchor  = "audit.anchor"
	KindCapped  = "audit.capped"
	KindDropped = "audit.dropped"
	KindStart   = "audit.start"
)

// Entry is one stored entry of the trail.
type Entry struct {
	Seq       int64 // 1, 2, 3, ...: the entry's place in the chain
	Time      time.Time
	Kind      string
	Source    string // SourceHost, SourceAgent or SourceCLI
	KeyID     string // the API key whose trail this is ("" the operator's alone, or the team's)
	TeamID    string // the team whose trail this is ("" a key without a team, or the operator)
	SandboxID string
	Route     string // an API call's method and route, an envd call's path
	Status    int    // the HTTP status the caller got (0: none)
	Client    string // the caller's address
	Detail    string // a JSON object
	Prev      string // the hash of entry Seq-1 (hex); 64 zeros for entry 1
	Hash      string // this entry's hash (hex)
}

// Genesis is the prev of the first entry of a chain.
var Genesis = strings.Repeat("0", 64)

// ComputeHash is an entry's hash: SHA-256 over a version tag and every
// stored field, prev first, each with its length, so no two different
// entries encode alike.
func (e *Entry) ComputeHash() string {
	h := sha256.New()
	io.WriteString(h, "cage-audit-v1\n")
	for _, f := range [...]string{e.Prev, strconv.FormatInt(e.Seq, 10), strconv.FormatInt(e.Time.UnixNano(), 10),
		e.Kind, e.Source, e.KeyID, e.TeamID, e.SandboxID, e.Route, strconv.Itoa(e.Status), e.Client, e.Detail} {
		field(h, f)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func field(h hash.Hash, s string) {
	var n [binary.MaxVarintLen64]byte
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(s)))])
	io.WriteString(h, s)
}

// Event is what a producer records; the trail numbers, times (when Time is
// zero), chains and stores it.
type Event struct {
	Time   time.Time
	Kind   string
	Source string // "" is SourceHost
	// KeyID is the key, or an owner (SplitOwner: a team's id goes to
	// TeamID when TeamID is empty).
	KeyID     string
	TeamID    string
	SandboxID string
	Route     string
	Status    int
	Client    string
	Detail    map[string]any // marshalled by the writer: not to be changed once recorded
}

// TeamPrefix begins a team's id (store.TeamPrefix).
const TeamPrefix = "team_"

// SplitOwner is an owner (store.APIKey.Owner: a team's id, or the id of
// a key without a team) as an entry's key and team.
func SplitOwner(owner string) (key, team string) {
	if strings.HasPrefix(owner, TeamPrefix) {
		return "", owner
	}
	return owner, ""
}

// family is a kind's family ("process" of "process.start").
func family(kind string) string {
	f, _, _ := strings.Cut(kind, ".")
	return f
}

// capped says whether entries of a kind count against their sandbox's cap:
// what a tenant can make happen at will (processes, files, envd calls,
// network decisions). Lifecycle, key and the trail's own entries are
// always kept.
func capped(kind string) bool {
	switch family(kind) {
	case "process", "file", "envd", "net":
		return true
	}
	return false
}

// ownedBySandbox says whether an entry of a kind belongs to its sandbox's
// owner when no key is given: what happens in or to a sandbox. API calls
// and refused proxy requests belong to whoever made them (no key: the
// operator alone).
func ownedBySandbox(kind string) bool {
	switch family(kind) {
	case "api", "proxy", "key", "team":
		return false
	}
	return true
}

// ends says whether a kind ends its sandbox.
func ends(kind string) bool {
	switch kind {
	case KindKill, KindTimeout, KindDied, KindRemoved:
		return true
	}
	return false
}

// ValidKind says whether s may be a kind or family in a filter: lower-case
// letters, digits, '_' and one '.'.
func ValidKind(s string) bool {
	if s == "" || len(s) > 64 || strings.Count(s, ".") > 1 || s[0] == '.' || s[len(s)-1] == '.' {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}
