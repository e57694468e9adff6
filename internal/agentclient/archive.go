package agentclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// ErrTooLarge is returned by Archive when the archive passes its limit.
var ErrTooLarge = errors.New("the sandbox's files are larger than the limit")

// Archive streams the tar of the sandbox's writable files (the agent's
// GET /cage/archive) into w, at most limit bytes. processes is "stop"
// (the sandbox's other processes halt while it is read, and go on after)
// or "kill".
func (c *Client) Archive(ctx context.Context, w io.Writer, processes string, limit int64) (int64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, BaseURL+"/cage/archive?processes="+processes, nil)
	if err != nil {
		return 0, err
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, statusError("archive", resp)
	}
	n, err := io.Copy(w, io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return n, fmt.Errorf("archive: %w", err)
	}
	if n > limit {
		return n, ErrTooLarge
	}
	return n, nil
}

// Restore unpacks a tar made by Archive over the sandbox's root (the
// agent's POST /cage/restore).
func (c *Client) Restore(ctx context.Context, r io.Reader) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, BaseURL+"/cage/restore", r)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/x-tar")
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return statusError("restore", resp)
	}
	return nil
}

// KillAll kills every process of the sandbox but its agent (the agent's
// POST /cage/kill): what a resume without memory leaves of a frozen one.
func (c *Client) KillAll(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, BaseURL+"/cage/kill", nil)
	if err != nil {
		return err
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		return statusError("kill", resp)
	}
	return nil
}

func statusError(what string, resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return fmt.Errorf("%s: %s: %s", what, resp.Status, strings.TrimSpace(string(b)))
}
