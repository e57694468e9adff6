package store

import (
	"context"
	"database/sql"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Sandbox states the daemon uses today. The store does not restrict State to
// these, so new states need no migration.
const (
	StateCreating = "creating"
	StateRunning  = "running"
	StatePaused   = "paused"
	StateKilled   = "killed"
)

// Sandbox is one row of the sandboxes table.
type Sandbox struct {
	ID            string // [a-z0-9]+
	KeyID         string // its owner: the creating key's team, or that key when it has none ("" allowed; see teams.go)
	TemplateID    string
	Wall          string // "process" today
	State         string // "creating", "running", "paused", "killed"
	Metadata      map[string]string
	EnvVars       map[string]string
	CPUs          float64
	Memory        int64 // bytes (whole MiB: the columns hold MiB)
	Disk          int64 // bytes (whole MiB: the columns hold MiB)
	Pids          int64
	AccessToken   string // envd access token (secret)
	TrafficToken  string // secret
	AgentPID      int    // host pid of the sandbox's agent (0 while creating)
	AgentStart    uint64 // start time of that pid (field 22 of /proc/PID/stat) to detect pid reuse
	StartedAt     time.Time
	EndAt         time.Time // when it is killed unless extended
	AllowInternet bool
	AutoPause     bool
	Network       string // the network policy as JSON; "" for none (loopback only)
	NetSlot       int    // the slot of its interface and rules; -1 for none
	PublicTraffic bool   // its exposed ports answer without the traffic token
	// Durable state (see Manager.Pause).
	PausedAt        time.Time     // when it was paused (zero while running)
	PauseKind       string        // "memory" (frozen, RAM kept) or "files" (saved to disk, RAM freed)
	AutoPauseMemory bool          // at timeout, pause keeping memory (with AutoPause)
	AutoResume      bool          // traffic through the proxy resumes it when paused
	TimeoutSeconds  int64         // the timeout it was created with
	VolumeMounts    []VolumeMount // volumes mounted at create
	HTTPSPorts      []int         // ports the proxy reaches over TLS (E2B's network.httpsPorts)
}

const sandboxCols = `id, key_id, template_id, wall, state, metadata, env_vars,
	cpus, memory_mb, disk_mb, pids, access_token, traffic_token,
	agent_pid, agent_start, started_at, end_at, allow_internet, auto_pause, network, net_slot, public_traffic,
	paused_at, pause_kind, auto_pause_memory, auto_resume, timeout_s, volume_mounts, https_ports`

// validID reports whether id is a non-empty string of [a-z0-9].
func validID(id string) bool {
	if id == "" {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return false
		}
	}
	return true
}

func encodeMap(m map[string]string) (string, error) {
	if len(m) == 0 {
		return "{}", nil
	}
	b, err := json.Marshal(m)
	return string(b), err
}

func decodeMap(s string) (map[string]string, error) {
	m := map[string]string{}
	if s == "" {
		return m, nil
	}
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		return nil, err
	}
	return m, nil
}

// sandboxArgs returns the values for sandboxCols, in order.
func sandboxArgs(sb *Sandbox) ([]any, error) {
	md, err := encodeMap(sb.Metadata)
	if err != nil {
		return nil, fmt.Errorf("metadata: %w", err)
	}
	env, err := encodeMap(sb.EnvVars)
	if err != nil {
		return nil, fmt.Errorf("env vars: %w", err)
	}
	mounts, err := encodeMounts(sb.VolumeMounts)
	if err != nil {
		return nil, fmt.Errorf("volume mounts: %w", err)
	}
	https, err := encodePorts(sb.HTTPSPorts)
	if err != nil {
		return nil, fmt.Errorf("https ports: %w", err)
	}
	return []any{
		sb.ID, sb.KeyID, sb.TemplateID, sb.Wall, sb.State, md, env,
		sb.CPUs, sb.Memory >> 20, sb.Disk >> 20, sb.Pids, sb.AccessToken, sb.TrafficToken,
		int64(sb.AgentPID),
		int64(sb.AgentStart), // same bits; SQLite integers are signed
		nanos(sb.StartedAt), nanos(sb.EndAt),
		boolInt(sb.AllowInternet), boolInt(sb.AutoPause), sb.Network, int64(sb.NetSlot), boolInt(sb.PublicTraffic),
		nanos(sb.PausedAt), sb.PauseKind, boolInt(sb.AutoPauseMemory), boolInt(sb.AutoResume), sb.TimeoutSeconds, mounts, https,
	}, nil
}

type scanner interface{ Scan(dest ...any) error }

func scanSandbox(r scanner) (*Sandbox, error) {
	var (
		sb              Sandbox
		md, env         string
		pid, start      int64
		started, end    int64
		internet, pause int64
		slot, public    int64
		memMiB, diskMiB int64
		pausedAt        int64
		apMem, aRes     int64
		mounts, https   string
	)
	err := r.Scan(&sb.ID, &sb.KeyID, &sb.TemplateID, &sb.Wall, &sb.State, &md, &env,
		&sb.CPUs, &memMiB, &diskMiB, &sb.Pids, &sb.AccessToken, &sb.TrafficToken,
		&pid, &start, &started, &end, &internet, &pause, &sb.Network, &slot, &public,
		&pausedAt, &sb.PauseKind, &apMem, &aRes, &sb.TimeoutSeconds, &mounts, &https)
	if err != nil {
		return nil, err
	}
	if sb.Metadata, err = decodeMap(md); err != nil {
		return nil, fmt.Errorf("sandbox %s: metadata: %w", sb.ID, err)
	}
	if sb.EnvVars, err = decodeMap(env); err != nil {
		return nil, fmt.Errorf("sandbox %s: env vars: %w", sb.ID, err)
	}
	sb.Memory, sb.Disk = memMiB<<20, diskMiB<<20
	sb.AgentPID = int(pid)
	sb.AgentStart = uint64(start)
	sb.StartedAt = fromNanos(started)
	sb.EndAt = fromNanos(end)
	sb.AllowInternet = internet != 0
	sb.AutoPause = pause != 0
	sb.NetSlot = int(slot)
	sb.PublicTraffic = public != 0
	sb.PausedAt = fromNanos(pausedAt)
	sb.AutoPauseMemory, sb.AutoResume = apMem != 0, aRes != 0
	if sb.VolumeMounts, err = decodeMounts(mounts); err != nil {
		return nil, fmt.Errorf("sandbox %s: volume mounts: %w", sb.ID, err)
	}
	if sb.HTTPSPorts, err = decodePorts(https); err != nil {
		return nil, fmt.Errorf("sandbox %s: https ports: %w", sb.ID, err)
	}
	return &sb, nil
}

// InsertSandbox adds a sandbox; ErrConflict if one with its ID exists.
func (s *Store) InsertSandbox(sb *Sandbox) error {
	if sb == nil || !validID(sb.ID) {
		return fmt.Errorf("store: insert sandbox: invalid id %q", idOf(sb))
	}
	args, err := sandboxArgs(sb)
	if err != nil {
		return fmt.Errorf("store: insert sandbox %s: %w", sb.ID, err)
	}
	st, err := s.prepared(insertSandboxSQL)
	if err != nil {
		return fmt.Errorf("store: insert sandbox %s: %w", sb.ID, err)
	}
	res, err := st.ExecContext(context.Background(), args...)
	if err != nil {
		return fmt.Errorf("store: insert sandbox %s: %w", sb.ID, err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return fmt.Errorf("store: insert sandbox %s: %w", sb.ID, err)
	} else if n == 0 {
		return fmt.Errorf("store: sandbox %s: %w", sb.ID, ErrConflict)
	}
	return nil
}

func idOf(sb *Sandbox) string {
	if sb == nil {
		return ""
	}
	return sb.ID
}

// GetSandbox returns the sandbox with the given ID, or ErrNotFound.
func (s *Store) GetSandbox(id string) (*Sandbox, error) {
	st, err := s.prepared(getSandboxSQL)
	if err != nil {
		return nil, fmt.Errorf("store: get sandbox %s: %w", id, err)
	}
	sb, err := scanSandbox(st.QueryRowContext(context.Background(), id))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("store: sandbox %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("store: get sandbox %s: %w", id, err)
	}
	return sb, nil
}

// SandboxAccess is what the traffic proxy reads of a sandbox's record on
// every request, anyone's: none of its metadata or environment.
type SandboxAccess struct {
	KeyID, State              string
	AccessToken, TrafficToken string
	PublicTraffic, AutoResume bool
	HTTPSPorts                []int
}

const getAccessSQL = "SELECT key_id, state, access_token, traffic_token, public_traffic, auto_resume, https_ports FROM sandboxes WHERE id = ?"

// GetSandboxAccess reads what the proxy needs of sandbox id, or returns
// ErrNotFound.
func (s *Store) GetSandboxAccess(id string) (*SandboxAccess, error) {
	st, err := s.prepared(getAccessSQL)
	if err != nil {
		return nil, fmt.Errorf("store: get sandbox %s: %w", id, err)
	}
	var a SandboxAccess
	var public, resume int64
	var https string
	err = st.QueryRowContext(context.Background(), id).Scan(&a.KeyID, &a.State, &a.AccessToken, &a.TrafficToken, &public, &resume, &https)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("store: sandbox %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("store: get sandbox %s: %w", id, err)
	}
	a.PublicTraffic, a.AutoResume = public != 0, resume != 0
	if a.HTTPSPorts, err = decodePorts(https); err != nil {
		return nil, fmt.Errorf("store: sandbox %s: https ports: %w", id, err)
	}
	return &a, nil
}

// UpdateSandbox overwrites every column of the sandbox with sb's ID, or
// returns ErrNotFound.
func (s *Store) UpdateSandbox(sb *Sandbox) error {
	if sb == nil {
		return errors.New("store: update sandbox: nil")
	}
	args, err := sandboxArgs(sb)
	if err != nil {
		return fmt.Errorf("store: update sandbox %s: %w", sb.ID, err)
	}
	args = append(args[1:], sb.ID)
	return s.execOne("update sandbox "+sb.ID, updateSandboxSQL, args...)
}

// The statements of a sandbox's row, built once from sandboxCols.
var (
	insertSandboxSQL = "INSERT INTO sandboxes (" + sandboxCols + ") VALUES (" +
		strings.TrimSuffix(strings.Repeat("?, ", len(strings.Split(sandboxCols, ","))), ", ") + ") ON CONFLICT (id) DO NOTHING"
	getSandboxSQL    = "SELECT " + sandboxCols + " FROM sandboxes WHERE id = ?"
	updateSandboxSQL = func() string {
		cols := strings.Split(sandboxCols, ",")
		sets := make([]string, 0, len(cols)-1)
		for _, c := range cols[1:] { // cols[0] is id
			sets = append(sets, strings.TrimSpace(c)+" = ?")
		}
		return "UPDATE sandboxes SET " + strings.Join(sets, ", ") + " WHERE id = ?"
	}()
)

// SetState changes a sandbox's state, or returns ErrNotFound.
func (s *Store) SetState(id, state string) error {
	return s.execOne("set state of sandbox "+id,
		"UPDATE sandboxes SET state = ? WHERE id = ?", state, id)
}

// SetEndAt changes when a sandbox times out, or returns ErrNotFound.
func (s *Store) SetEndAt(id string, end time.Time) error {
	return s.execOne("set end of sandbox "+id,
		"UPDATE sandboxes SET end_at = ? WHERE id = ?", nanos(end), id)
}

// DeleteSandbox removes a sandbox, or returns ErrNotFound. Its events stay:
// they are an audit trail (see PruneEvents).
func (s *Store) DeleteSandbox(id string) error {
	return s.execOne("delete sandbox "+id, "DELETE FROM sandboxes WHERE id = ?", id)
}

// execOne runs a statement that must affect a row, else ErrNotFound.
func (s *Store) execOne(what, query string, args ...any) error {
	st, err := s.prepared(query)
	if err != nil {
		return fmt.Errorf("store: %s: %w", what, err)
	}
	res, err := st.ExecContext(context.Background(), args...)
	if err != nil {
		return fmt.Errorf("store: %s: %w", what, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return fmt.Errorf("store: %s: %w", what, err)
	}
	if n == 0 {
		return fmt.Errorf("store: %s: %w", what, ErrNotFound)
	}
	return nil
}

// ListFilter selects sandboxes for ListSandboxes.
type ListFilter struct {
	KeyID        string            // "" = any key
	States       []string          // empty = any
	Metadata     map[string]string // all must match exactly
	Template     string            // "" = any; else the template the sandbox was created from, exactly
	StartedAfter time.Time         // zero = any; else started at or after it
	Desc         bool              // newest first (E2B's default order) instead of oldest first
	Limit        int               // 0 = no limit
	Cursor       string            // "" = from the start; else a next value from ListSandboxes
}

// listCols are sandboxCols as a list reads them: no environment (up to
// 64 KiB a sandbox, which no list shows) and no tokens.
var listCols = strings.NewReplacer("env_vars", "'{}'", "access_token", "''", "traffic_token", "''").Replace(sandboxCols)

// ListSandboxes returns sandboxes matching f, without their environments
// and tokens (EnvVars empty, AccessToken and TrafficToken ""), ordered by
// StartedAt then ID (both descending when f.Desc), starting after
// f.Cursor, at most f.Limit of them. next is the cursor to pass to get the following page (E2B's
// X-Next-Token), "" when there is none; it is a position, so a cursor goes
// on in the order of the request that passes it. A malformed cursor gives an
// error wrapping ErrInvalidCursor.
func (s *Store) ListSandboxes(f ListFilter) (items []*Sandbox, next string, err error) {
	if f.Limit < 0 {
		return nil, "", fmt.Errorf("store: list sandboxes: negative limit %d", f.Limit)
	}
	var (
		where []string
		args  []any
	)
	if f.KeyID != "" {
		where = append(where, "key_id = ?")
		args = append(args, f.KeyID)
	}
	if len(f.States) > 0 {
		where = append(where, "state IN ("+strings.TrimSuffix(strings.Repeat("?, ", len(f.States)), ", ")+")")
		for _, st := range f.States {
			args = append(args, st)
		}
	}
	keys := make([]string, 0, len(f.Metadata))
	for k := range f.Metadata {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		// json_each's key column is the member name as text, so any
		// characters in keys and values match literally (no JSON paths).
		where = append(where, `EXISTS (SELECT 1 FROM json_each(sandboxes.metadata) AS m
			WHERE m.key = ? AND m.type = 'text' AND m.value = ?)`)
		args = append(args, k, f.Metadata[k])
	}
	if f.Template != "" {
		where = append(where, "template_id = ?")
		args = append(args, f.Template)
	}
	if !f.StartedAfter.IsZero() {
		where = append(where, "started_at >= ?")
		args = append(args, clampedNanos(f.StartedAfter))
	}
	after, order := ">", " ORDER BY started_at, id"
	if f.Desc {
		after, order = "<", " ORDER BY started_at DESC, id DESC"
	}
	if f.Cursor != "" {
		at, id, err := decodeCursor(f.Cursor)
		if err != nil {
			return nil, "", fmt.Errorf("store: list sandboxes: %w", err)
		}
		where = append(where, "(started_at, id) "+after+" (?, ?)")
		args = append(args, at, id)
	}
	q := "SELECT " + listCols + " FROM sandboxes"
	if len(where) > 0 {
		q += " WHERE " + strings.Join(where, " AND ")
	}
	q += order
	if f.Limit > 0 {
		q += " LIMIT ?"
		args = append(args, f.Limit+1) // one extra tells whether there is more
	}
	items, err = s.querySandboxes(q, args...)
	if err != nil {
		return nil, "", fmt.Errorf("store: list sandboxes: %w", err)
	}
	if f.Limit > 0 && len(items) > f.Limit {
		items = items[:f.Limit]
		last := items[len(items)-1]
		next = encodeCursor(nanos(last.StartedAt), last.ID)
	}
	return items, next, nil
}

// clampedNanos is t in Unix nanoseconds, saturated where int64 ends (years
// 1677 and 2262) instead of wrapping.
func clampedNanos(t time.Time) int64 {
	switch {
	case t.Before(time.Unix(0, math.MinInt64)):
		return math.MinInt64
	case t.After(time.Unix(0, math.MaxInt64)):
		return math.MaxInt64
	}
	return t.UnixNano()
}

// AllSandboxes returns every sandbox in any state, ordered like
// ListSandboxes; the daemon reconciles them with reality at start.
func (s *Store) AllSandboxes() ([]*Sandbox, error) {
	items, err := s.querySandboxes("SELECT " + sandboxCols + " FROM sandboxes ORDER BY started_at, id")
	if err != nil {
		return nil, fmt.Errorf("store: all sandboxes: %w", err)
	}
	return items, nil
}

func (s *Store) querySandboxes(q string, args ...any) ([]*Sandbox, error) {
	rows, err := s.db.QueryContext(context.Background(), q, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var items []*Sandbox
	for rows.Next() {
		sb, err := scanSandbox(rows)
		if err != nil {
			return nil, err
		}
		items = append(items, sb)
	}
	return items, rows.Err()
}

// Cursors are base64url("v1." + started_at nanos + "." + id). Opaque to
// callers; checked strictly here since they come from HTTP clients.
const cursorVersion = "v1"

func encodeCursor(at int64, id string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(cursorVersion + "." + strconv.FormatInt(at, 10) + "." + id))
}

func decodeCursor(c string) (int64, string, error) {
	b, err := base64.RawURLEncoding.DecodeString(c)
	if err != nil {
		return 0, "", fmt.Errorf("%w: %q", ErrInvalidCursor, c)
	}
	parts := strings.Split(string(b), ".")
	if len(parts) != 3 || parts[0] != cursorVersion || !validID(parts[2]) {
		return 0, "", fmt.Errorf("%w: %q", ErrInvalidCursor, c)
	}
	at, err := strconv.ParseInt(parts[1], 10, 64)
	if err != nil {
		return 0, "", fmt.Errorf("%w: %q", ErrInvalidCursor, c)
	}
	return at, parts[2], nil
}

// encodePorts is a list of ports as its column keeps it (JSON; "[]" for none).
func encodePorts(ports []int) (string, error) {
	if len(ports) == 0 {
		return "[]", nil
	}
	b, err := json.Marshal(ports)
	return string(b), err
}

// decodePorts reads a list of ports back (nil for none).
func decodePorts(s string) ([]int, error) {
	var ports []int
	if s == "" || s == "[]" {
		return nil, nil
	}
	if err := json.Unmarshal([]byte(s), &ports); err != nil {
		return nil, err
	}
	return ports, nil
}
