package daemon

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestConfigPools: pools in a config file name a template, on the default
// wall or on WALL/; an unknown wall is refused as the file is read, in one
// line naming it; pool_grow is 1 to 64.
func TestConfigPools(t *testing.T) {
	dir := t.TempDir()
	load := func(body string) (Config, error) {
		p := filepath.Join(dir, "cage.json")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg := Defaults()
		return cfg, LoadFile(p, &cfg)
	}
	cfg, err := load(`{"pools": {"base": 1, "gvisor/base": 2, "microvm/base": 1}}`)
	if err != nil || cfg.Pools["gvisor/base"] != 2 || len(cfg.Pools) != 3 {
		t.Errorf("pools on walls: %v %v", cfg.Pools, err)
	}
	_, err = load(`{"pools": {"nowall/base": 1}}`)
	if err == nil || !strings.Contains(err.Error(), `"nowall"`) || strings.Contains(err.Error(), "\n") {
		t.Errorf("a pool on an unknown wall: %v", err)
	}
	// pool_grow: 4 unless set, 1 to 64.
	if cfg, err = load(`{}`); err != nil || cfg.PoolGrow != 4 {
		t.Errorf("pool_grow by default: %d %v", cfg.PoolGrow, err)
	}
	if cfg, err = load(`{"pool_grow": 1}`); err != nil || cfg.PoolGrow != 1 {
		t.Errorf("pool_grow 1: %d %v", cfg.PoolGrow, err)
	}
	for _, bad := range []string{"0", "-2", "65"} {
		_, err = load(`{"pool_grow": ` + bad + `}`)
		if err == nil || !strings.Contains(err.Error(), "pool_grow "+bad+": want 1") || strings.Contains(err.Error(), "\n") {
			t.Errorf("pool_grow %s: %v", bad, err)
		}
	}
}
