package interp

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"github.com/cagehq/cage/internal/interp/jupyter"
)

// codeContext is one context: a kernel holding a language's state, which
// runs one execution at a time.
type codeContext struct {
	ID, Language, Cwd string
	kernel            Kernel
	turn              chan struct{} // holds a token while a run (or restart) has the kernel

	mu     sync.Mutex
	ending string // why a run in progress ends: "restarted" or "removed"
}

func (c *codeContext) json() contextJSON {
	return contextJSON{ID: c.ID, Language: c.Language, Cwd: c.Cwd}
}

// acquire waits for the context's turn; false when ctx ended first.
func (c *codeContext) acquire(ctx context.Context) bool {
	select {
	case c.turn <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

func (c *codeContext) release() { <-c.turn }

// restart forgets the context's state: a run in progress ends (it is told
// the context was restarted), the kernel starts again, the ID stays.
func (c *codeContext) restart(ctx context.Context) error {
	c.mu.Lock()
	c.ending = "restarted"
	c.mu.Unlock()
	return c.kernel.Restart(ctx)
}

// remove ends the context's kernel; a run in progress is told so.
func (c *codeContext) remove() {
	c.mu.Lock()
	c.ending = "removed"
	c.mu.Unlock()
	_ = c.kernel.Close()
}

// endedBy says why the context's kernel went away under a run, and
// clears it.
func (c *codeContext) endedBy() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.ending
	c.ending = ""
	return e
}

// normalize is a language as E2B's server names it (lower case; js and ts
// spelled out); python when none.
func normalize(lang string) string {
	lang = strings.ToLower(strings.TrimSpace(lang))
	switch lang {
	case "":
		return "python"
	case "js":
		return "javascript"
	case "ts":
		return "typescript"
	}
	return lang
}

// language finds the language a request names, or says why it cannot run.
func (s *Server) language(name string) (Language, error) {
	l, ok := s.cfg.Languages[name]
	if !ok {
		names := make([]string, 0, len(s.cfg.Languages))
		for n := range s.cfg.Languages {
			names = append(names, n)
		}
		sort.Strings(names)
		return Language{}, fmt.Errorf("%w: unknown language %q: this code interpreter runs %s", errBadRequest,
			truncate(name, 40), strings.Join(names, ", "))
	}
	if l.Missing != nil {
		if why := l.Missing(); why != "" {
			return Language{}, fmt.Errorf("%w: language %q cannot run in this sandbox: %s", errBadRequest, name, why)
		}
	}
	return l, nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

// newContext makes a context of lang (normalized) whose kernel starts in cwd.
func (s *Server) newContext(ctx context.Context, lang, cwd string) (*codeContext, error) {
	lang = normalize(lang)
	l, err := s.language(lang)
	if err != nil {
		return nil, err
	}
	if !filepath.IsAbs(cwd) {
		return nil, fmt.Errorf("%w: cwd %q is not an absolute path", errBadRequest, truncate(cwd, 200))
	}
	if fi, err := os.Stat(cwd); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("%w: cwd %q is not a directory in this sandbox", errBadRequest, truncate(cwd, 200))
	}
	// A place is reserved before the kernel starts: creates at once may
	// not start more kernels than the limit (before, 200 at once ran 200
	// kernels, the surplus closed only after they had started).
	s.mu.Lock()
	if n := len(s.contexts) + s.starting; n >= s.cfg.MaxContexts {
		s.mu.Unlock()
		return nil, fmt.Errorf("%w: %d contexts exist or are starting, this code interpreter's limit; remove one first (removeCodeContext)", errLimit, n)
	}
	s.starting++
	s.mu.Unlock()
	k, err := l.Start(ctx, cwd)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.starting--
	if err != nil {
		return nil, fmt.Errorf("start a %s context: %w", lang, err)
	}
	c := &codeContext{ID: jupyter.NewID(), Language: lang, Cwd: cwd, kernel: k, turn: make(chan struct{}, 1)}
	s.contexts[c.ID] = c
	return c, nil
}

// defaultContext is lang's default context, made on first use in the
// default directory.
func (s *Server) defaultContext(ctx context.Context, lang string) (*codeContext, error) {
	lang = normalize(lang)
	if _, err := s.language(lang); err != nil {
		return nil, err
	}
	s.mu.Lock()
	c := s.defaults[lang]
	m := s.creating[lang]
	if m == nil {
		m = &sync.Mutex{}
		s.creating[lang] = m
	}
	s.mu.Unlock()
	if c != nil {
		return c, nil
	}
	m.Lock()
	defer m.Unlock()
	s.mu.Lock()
	c = s.defaults[lang]
	s.mu.Unlock()
	if c != nil {
		return c, nil
	}
	cwd := s.cfg.Cwd
	if fi, err := os.Stat(cwd); err != nil || !fi.IsDir() {
		if cwd, err = os.Getwd(); err != nil {
			return nil, err
		}
	}
	c, err := s.newContext(ctx, lang, cwd)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.defaults[lang] = c
	s.mu.Unlock()
	return c, nil
}

func (s *Server) context(id string) *codeContext {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.contexts[id]
}

// Close ends every context's kernel.
func (s *Server) Close() {
	s.mu.Lock()
	cs := s.contexts
	s.contexts, s.defaults = map[string]*codeContext{}, map[string]*codeContext{}
	s.mu.Unlock()
	for _, c := range cs {
		c.remove()
	}
}

// kernelGone is a run's kernel ending under it, as the run's error line.
func kernelGone(c *codeContext, err error) (name, value, traceback string) {
	switch c.endedBy() {
	case "restarted":
		return "ContextRestarting", "Context was restarted", ""
	case "removed":
		return "ContextRemoved", "Context was removed", ""
	}
	var exit *jupyter.ExitError
	if errors.As(err, &exit) {
		return "KernelDied", fmt.Sprintf("the %s kernel of context %s exited (%s) and its state is lost; restart the context (restartCodeContext) to run code in it again",
			c.Language, c.ID, exit.Status), exit.Stderr
	}
	return "ExecutionError", err.Error(), ""
}
