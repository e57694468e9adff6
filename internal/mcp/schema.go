package mcp

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"sync"

	"github.com/google/jsonschema-go/jsonschema"
)

// Bounds of the tools' inputs, in the schemas and checked again in code
// (a test may call a handler without the SDK's validation).
const (
	maxIDLen      = 64
	maxPathLen    = 4096
	maxCommandLen = 128<<10 - 1 // one argv string: the kernel's MAX_ARG_STRLEN less the NUL
	maxCodeLen    = 1 << 20
	maxEnvs       = 256
	maxEnvValue   = 32 << 10
	maxMetadata   = 64

	defaultExecTimeout = 60
	maxExecTimeout     = 3600

	defaultOutput = 32 << 10 // per stream, exec and run_code
	minOutput     = 1 << 10
	maxOutput     = 1 << 20

	defaultReadBytes = 128 << 10
	maxReadBytes     = 8 << 20
	maxWriteBytes    = 4 << 20 // decoded content of one file_write

	defaultListEntries = 1000
	maxListEntries     = 10000
	maxListDepth       = 5
)

// The patterns are compiled on first use, not at every cage process's
// start (`cage run` never needs them).
var (
	idRE      = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-z0-9][a-z0-9-]*$`) })
	envNameRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`) })
	modeRE    = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^0?[0-7]{3,4}$`) })
)

// schemaFor is T's inferred input schema with fix applied to its
// properties (defaults, bounds, enums), built once per tool.
func schemaFor[T any](fix func(p props)) *jsonschema.Schema {
	s, err := jsonschema.For[T](nil)
	if err != nil {
		panic(fmt.Sprintf("mcp: schema of %T: %v", *new(T), err))
	}
	if fix != nil {
		fix(props{s})
	}
	return s
}

// props edits an object schema's properties by name; a name the type does
// not have is a programming error.
type props struct{ s *jsonschema.Schema }

func (p props) get(name string) *jsonschema.Schema {
	ps, ok := p.s.Properties[name]
	if !ok {
		panic("mcp: no property " + name)
	}
	return ps
}

func (p props) def(name string, v any) props {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	p.get(name).Default = b
	return p
}

func (p props) rng(name string, lo, hi float64) props {
	ps := p.get(name)
	ps.Minimum, ps.Maximum = &lo, &hi
	return p
}

func (p props) enum(name string, vals ...string) props {
	ps := p.get(name)
	for _, v := range vals {
		ps.Enum = append(ps.Enum, v)
	}
	return p
}

func (p props) maxLen(name string, n int) props {
	p.get(name).MaxLength = &n
	return p
}

func (p props) minLen(name string, n int) props {
	p.get(name).MinLength = &n
	return p
}

func (p props) pattern(name, re string) props {
	p.get(name).Pattern = re
	return p
}

func (p props) maxProps(name string, n int) props {
	p.get(name).MaxProperties = &n
	return p
}

// sandboxID bounds the sandbox_id property every tool but create and list has.
func (p props) sandboxID() props {
	return p.minLen("sandbox_id", 1).maxLen("sandbox_id", maxIDLen).pattern("sandbox_id", idRE().String())
}

// Checks the handlers make themselves, whatever validated the input.

func checkID(id string) error {
	if len(id) == 0 || len(id) > maxIDLen || !idRE().MatchString(id) {
		return fmt.Errorf("sandbox_id %q: not a sandbox id (lowercase letters, digits and dashes, as sandbox_create and sandbox_list give them)", clip(id, 80))
	}
	return nil
}

func checkPath(name, p string) error {
	switch {
	case p == "":
		return fmt.Errorf("%s is empty: give an absolute path or one relative to the user's home", name)
	case len(p) > maxPathLen:
		return fmt.Errorf("%s is longer than %d bytes", name, maxPathLen)
	case strings.ContainsRune(p, 0):
		return fmt.Errorf("%s contains a NUL byte", name)
	}
	return nil
}

func checkEnvs(envs map[string]string) error {
	if len(envs) > maxEnvs {
		return fmt.Errorf("envs: %d variables, at most %d", len(envs), maxEnvs)
	}
	for k, v := range envs {
		if !envNameRE().MatchString(k) {
			return fmt.Errorf("envs: %q is not a variable name ([A-Za-z_][A-Za-z0-9_]*)", clip(k, 80))
		}
		if strings.ContainsRune(v, 0) || len(v) > maxEnvValue {
			return fmt.Errorf("envs: the value of %s has a NUL byte or is longer than %d bytes", k, maxEnvValue)
		}
	}
	return nil
}

// clip shortens s for an error message.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

func ptr[T any](v T) *T { return &v }

// lazySchema is schemaFor made on first use: reflecting over every tool's
// input type at package init cost every cage command (`cage run` too) a
// quarter of a millisecond.
func lazySchema[T any](fix func(p props)) func() *jsonschema.Schema {
	return sync.OnceValue(func() *jsonschema.Schema { return schemaFor[T](fix) })
}
