package daemon

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestConfigPools: pools in a config file name a template, on the default
// wall or on WALL/; an unknown wall is refused as the file is read, in one
// line naming it.
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
}
