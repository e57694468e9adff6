package filesig

import (
	"errors"
	"net/url"
	"strconv"
	"testing"
	"time"
)

func query(path, user, sig string, exp int64) url.Values {
	q := url.Values{"path": {path}, "username": {user}, "signature": {sig}}
	if exp != 0 {
		q.Set("signature_expiration", strconv.FormatInt(exp, 10))
	}
	return q
}

func TestCheck(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	good := Sign("/home/user/a.txt", "read", "user", "tok", 0)
	future := now.Unix() + 60
	cases := []struct {
		name string
		q    url.Values
		op   string
		want error
	}{
		{"valid", query("/home/user/a.txt", "user", good, 0), "read", nil},
		{"valid with expiry", query("/x", "user", Sign("/x", "write", "user", "tok", future), future), "write", nil},
		{"no signature", url.Values{"path": {"/x"}}, "read", ErrMissing},
		{"other operation", query("/home/user/a.txt", "user", good, 0), "write", ErrInvalid},
		{"other path", query("/etc/passwd", "user", good, 0), "read", ErrInvalid},
		{"other user", query("/home/user/a.txt", "root", good, 0), "read", ErrInvalid},
		{"other token", query("/x", "user", Sign("/x", "read", "user", "guess", 0), 0), "read", ErrInvalid},
		{"expiry added to an unexpiring signature", query("/home/user/a.txt", "user", good, future), "read", ErrInvalid},
		{"expired", query("/x", "user", Sign("/x", "read", "user", "tok", now.Unix()-1), now.Unix()-1), "read", ErrExpired},
		{"malformed expiry", url.Values{"path": {"/x"}, "signature": {good}, "signature_expiration": {"soon"}}, "read", ErrBadTime},
	}
	for _, c := range cases {
		if err := Check(c.q, c.op, "tok", now); !errors.Is(err, c.want) && !(err == nil && c.want == nil) {
			t.Errorf("%s: Check = %v, want %v", c.name, err, c.want)
		}
	}
}

// TestSignKnownAnswer pins the format E2B's SDKs compute on their side.
func TestSignKnownAnswer(t *testing.T) {
	// sha256("/a:read:user:t") in unpadded standard base64.
	if got, want := Sign("/a", "read", "user", "t", 0), "v1_O9lDkqs41pWNGGWAlwD5wdq11mG78tUg3oWrv5BVvZk"; got != want {
		t.Errorf("Sign = %s, want %s", got, want)
	}
}
