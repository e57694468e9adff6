package client

import (
	"context"
	"net/http"
	"net/url"

	"github.com/cagehq/cage/api/types"
)

// AuditPage returns one page of the key's audit trail (GET /audit); q
// holds the filters (sandboxID, kind, since, until, limit) and the page's
// nextToken.
func (c *Client) AuditPage(ctx context.Context, q url.Values) (*types.AuditPage, error) {
	var page types.AuditPage
	_, err := c.do(ctx, http.MethodGet, "/audit?"+q.Encode(), nil, &page)
	return &page, err
}
