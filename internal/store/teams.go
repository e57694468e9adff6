package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"time"
)

// Teams are the tenancy boundary. A team owns what its keys make: the
// sandboxes, snapshots and volumes tables' key_id column holds the owner,
// which is the key's team ("team_" + 12 hex), or the key's own id for a key
// without a team (such a key is a team of its own, as before teams
// existed). Ids of both kinds are minted here and never collide.

// TeamPrefix begins every team's id.
const TeamPrefix = "team_"

// Team is one row of the teams table.
type Team struct {
	ID        string // "team_" + 12 hex
	Name      string // unique; see ValidTeamName
	Limits    TeamLimits
	CreatedAt time.Time
}

// TeamLimits are a team's quotas and its keys' rate limits; a zero field
// is no quota of the team's (the server's own bounds still hold).
type TeamLimits struct {
	// Quotas on what the team holds at once. Sandboxes counts those
	// running or being made; CPUs the vCPUs of those; Memory the memory
	// limits of those and of sandboxes paused with their memory (frozen:
	// the host still holds it); Disk the disk sizes of all the team's
	// sandboxes, paused ones included, and the bytes of its snapshots;
	// Paused the paused sandboxes.
	Sandboxes int64   `json:"sandboxes,omitempty"`
	CPUs      float64 `json:"cpus,omitempty"`
	Memory    int64   `json:"memory,omitempty"` // bytes
	Disk      int64   `json:"disk,omitempty"`   // bytes
	Paused    int64   `json:"paused,omitempty"`
	// Rate limits of each of the team's keys (0: the server's default):
	// API requests a second and creates (create, resume, connect, fork) a
	// second, each with a burst of twice the rate (at least 1).
	Requests float64 `json:"requests_per_s,omitempty"`
	Creates  float64 `json:"creates_per_s,omitempty"`
}

// Valid says what is wrong with l, if anything.
func (l TeamLimits) Valid() error {
	if l.Sandboxes < 0 || l.CPUs < 0 || l.Memory < 0 || l.Disk < 0 || l.Paused < 0 || l.Requests < 0 || l.Creates < 0 {
		return errors.New("quotas and rates are 0 (none) or more")
	}
	if l.CPUs > 1e6 || l.Requests > 1e6 || l.Creates > 1e6 || l.Sandboxes > 1e9 || l.Paused > 1e9 {
		return errors.New("a quota or rate is beyond any host")
	}
	return nil
}

// Compiled at first use: a counted repetition compiles into a program of
// its size, work every cage process (cage run included) paid at its start.
var teamNameRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,62}$`) })

// ValidTeamName says whether s may name a team: 1 to 63 lowercase
// letters, digits, '-' and '_', starting with a letter or digit, and not
// shaped like a team's id.
func ValidTeamName(s string) bool {
	return teamNameRE().MatchString(s) && !strings.HasPrefix(s, TeamPrefix)
}

const teamCols = "id, name, limits, created_at"

func scanTeam(r scanner) (*Team, error) {
	var t Team
	var limits string
	var created int64
	if err := r.Scan(&t.ID, &t.Name, &limits, &created); err != nil {
		return nil, err
	}
	if err := json.Unmarshal([]byte(limits), &t.Limits); err != nil {
		return nil, fmt.Errorf("team %s: limits: %w", t.ID, err)
	}
	t.CreatedAt = fromNanos(created)
	return &t, nil
}

// CreateTeam makes a team; ErrConflict when the name is taken.
func (s *Store) CreateTeam(name string, l TeamLimits) (*Team, error) {
	if !ValidTeamName(name) {
		return nil, fmt.Errorf("store: team name %q: want 1 to 63 of a-z, 0-9, '-' and '_', not starting with %q", name, TeamPrefix)
	}
	if err := l.Valid(); err != nil {
		return nil, fmt.Errorf("store: team %q: %v", name, err)
	}
	b, _ := json.Marshal(l)
	for attempt := 0; attempt < 5; attempt++ {
		idHex, err := randomHex(6)
		if err != nil {
			return nil, fmt.Errorf("store: create team: %w", err)
		}
		t := &Team{ID: TeamPrefix + idHex, Name: name, Limits: l, CreatedAt: fromNanos(nanos(s.now()))}
		_, err = s.db.ExecContext(context.Background(), "INSERT INTO teams ("+teamCols+") VALUES (?, ?, ?, ?)",
			t.ID, t.Name, string(b), nanos(t.CreatedAt))
		switch {
		case err == nil:
			return t, nil
		case strings.Contains(err.Error(), "teams.name"):
			return nil, fmt.Errorf("store: team %q: %w", name, ErrConflict)
		case !strings.Contains(err.Error(), "UNIQUE"):
			return nil, fmt.Errorf("store: create team: %w", err)
		}
	}
	return nil, fmt.Errorf("store: create team: %w", ErrConflict)
}

// GetTeam returns the team whose id or name is ref, or ErrNotFound.
func (s *Store) GetTeam(ref string) (*Team, error) {
	t, err := scanTeam(s.db.QueryRowContext(context.Background(),
		"SELECT "+teamCols+" FROM teams WHERE id = ? OR name = ? ORDER BY id = ? DESC LIMIT 1", ref, ref, ref))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("store: team %q: %w", ref, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("store: get team %q: %w", ref, err)
	}
	return t, nil
}

// ListTeams returns every team, by name.
func (s *Store) ListTeams() ([]*Team, error) {
	rows, err := s.db.QueryContext(context.Background(), "SELECT "+teamCols+" FROM teams ORDER BY name")
	if err != nil {
		return nil, fmt.Errorf("store: list teams: %w", err)
	}
	defer rows.Close()
	out := []*Team{}
	for rows.Next() {
		t, err := scanTeam(rows)
		if err != nil {
			return nil, fmt.Errorf("store: list teams: %w", err)
		}
		out = append(out, t)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: list teams: %w", err)
	}
	return out, nil
}

// SetTeamLimits replaces a team's quotas and rates.
func (s *Store) SetTeamLimits(id string, l TeamLimits) error {
	if err := l.Valid(); err != nil {
		return fmt.Errorf("store: team %s: %v", id, err)
	}
	b, _ := json.Marshal(l)
	return s.execOne("set limits of team "+id, "UPDATE teams SET limits = ? WHERE id = ?", string(b), id)
}

// DeleteTeam removes a team that holds nothing: ErrConflict, naming what
// it still holds, while it has a key not revoked, a sandbox, a snapshot or
// a volume; ErrNotFound when there is no such team.
func (s *Store) DeleteTeam(id string) error {
	ctx := context.Background()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("store: delete team: %w", err)
	}
	defer tx.Rollback()
	var held []string
	for _, q := range []struct{ what, sql string }{
		{"keys not revoked", "SELECT COUNT(*) FROM api_keys WHERE team_id = ? AND revoked_at IS NULL"},
		{"sandboxes", "SELECT COUNT(*) FROM sandboxes WHERE key_id = ?"},
		{"snapshots", "SELECT COUNT(*) FROM snapshots WHERE key_id = ?"},
		{"volumes", "SELECT COUNT(*) FROM volumes WHERE key_id = ?"},
	} {
		var n int
		if err := tx.QueryRowContext(ctx, q.sql, id).Scan(&n); err != nil {
			return fmt.Errorf("store: delete team: %w", err)
		}
		if n > 0 {
			held = append(held, fmt.Sprintf("%d %s", n, q.what))
		}
	}
	if len(held) > 0 {
		return fmt.Errorf("store: team %s still has %s: %w", id, strings.Join(held, ", "), ErrConflict)
	}
	res, err := tx.ExecContext(ctx, "DELETE FROM teams WHERE id = ?", id)
	if err != nil {
		return fmt.Errorf("store: delete team: %w", err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("store: team %s: %w", id, ErrNotFound)
	}
	return tx.Commit()
}

// Usage is what an owner holds now (see TeamLimits for what counts where).
type Usage struct {
	Sandboxes int64   // running or being made
	CPUs      float64 // of those
	Memory    int64   // bytes: of those, and of sandboxes paused with their memory
	Disk      int64   // bytes: of every sandbox, paused ones included, a checkpointed one's memory too, and of the owner's snapshots (Usage)
	Paused    int64
}

// PauseCheckpoint is the pause kind whose memory is written to the host's
// disk (a checkpoint, up to the sandbox's memory): such a paused sandbox
// counts its memory in Disk beside its disk.
const PauseCheckpoint = "checkpoint"

// Usage sums what owner's sandboxes hold, and in Disk its snapshots'
// archives too; memoryKinds are the pause kinds that keep a paused
// sandbox's memory on the host.
func (s *Store) Usage(owner string, memoryKinds ...string) (Usage, error) {
	u, err := s.usage("key_id = ?", owner, memoryKinds)
	if err != nil {
		return u, err
	}
	var snaps int64
	if err := s.db.QueryRowContext(context.Background(), "SELECT COALESCE(SUM(size), 0) FROM snapshots WHERE key_id = ?", owner).Scan(&snaps); err != nil {
		return u, fmt.Errorf("store: snapshots of %s: %w", owner, err)
	}
	u.Disk += snaps
	return u, nil
}

// KeptOnDisk is what owner keeps in the host's data directory: its paused
// sandboxes' files, counted at their disk sizes, a checkpointed one's
// memory too, and its snapshots' archives (the bound of a key without a
// team; see manager's KeyDisk).
func (s *Store) KeptOnDisk(owner string) (int64, error) {
	var mb, snaps int64
	err := s.db.QueryRowContext(context.Background(), `SELECT
		COALESCE(SUM(disk_mb + CASE WHEN pause_kind = ? THEN memory_mb ELSE 0 END), 0)
		FROM sandboxes WHERE state = ? AND key_id = ?`, PauseCheckpoint, StatePaused, owner).Scan(&mb)
	if err != nil {
		return 0, fmt.Errorf("store: paused sandboxes of %s: %w", owner, err)
	}
	if err := s.db.QueryRowContext(context.Background(), "SELECT COALESCE(SUM(size), 0) FROM snapshots WHERE key_id = ?", owner).Scan(&snaps); err != nil {
		return 0, fmt.Errorf("store: snapshots of %s: %w", owner, err)
	}
	return mb<<20 + snaps, nil
}

// TotalUsage sums what every sandbox holds (the host's committed share).
func (s *Store) TotalUsage(memoryKinds ...string) (Usage, error) {
	return s.usage("? = ''", "", memoryKinds)
}

func (s *Store) usage(where, owner string, memoryKinds []string) (Usage, error) {
	var u Usage
	var mem, disk int64
	kinds := "''"
	args := []any{StateRunning, StateCreating, StateRunning, StateCreating, StateRunning, StateCreating, StatePaused}
	if len(memoryKinds) > 0 {
		kinds = strings.TrimSuffix(strings.Repeat("?, ", len(memoryKinds)), ", ")
		for _, k := range memoryKinds {
			args = append(args, k)
		}
	}
	args = append(args, StatePaused, PauseCheckpoint, StatePaused, owner)
	err := s.db.QueryRowContext(context.Background(), `SELECT
		COALESCE(SUM(state IN (?, ?)), 0),
		COALESCE(SUM(CASE WHEN state IN (?, ?) THEN cpus ELSE 0 END), 0),
		COALESCE(SUM(CASE WHEN state IN (?, ?) OR (state = ? AND pause_kind IN (`+kinds+`)) THEN memory_mb ELSE 0 END), 0),
		COALESCE(SUM(disk_mb + CASE WHEN state = ? AND pause_kind = ? THEN memory_mb ELSE 0 END), 0),
		COALESCE(SUM(state = ?), 0)
		FROM sandboxes WHERE `+where, args...).Scan(&u.Sandboxes, &u.CPUs, &mem, &disk, &u.Paused)
	if err != nil {
		return u, fmt.Errorf("store: usage of %s: %w", owner, err)
	}
	u.Memory, u.Disk = mem<<20, disk<<20
	return u, nil
}

// SandboxCount is one group of ListSandboxCounts.
type SandboxCount struct {
	State, Wall, Template, Owner string
	N                            int
}

// SandboxCounts counts the sandboxes by state, wall, template and owner
// (for the daemon's metrics).
func (s *Store) SandboxCounts() ([]SandboxCount, error) {
	rows, err := s.db.QueryContext(context.Background(),
		"SELECT state, wall, template_id, key_id, COUNT(*) FROM sandboxes GROUP BY state, wall, template_id, key_id")
	if err != nil {
		return nil, fmt.Errorf("store: count sandboxes: %w", err)
	}
	defer rows.Close()
	var out []SandboxCount
	for rows.Next() {
		var c SandboxCount
		if err := rows.Scan(&c.State, &c.Wall, &c.Template, &c.Owner, &c.N); err != nil {
			return nil, fmt.Errorf("store: count sandboxes: %w", err)
		}
		out = append(out, c)
	}
	return out, rows.Err()
}
