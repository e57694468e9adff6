package jupyter

import (
	"encoding/json"
	"testing"
)

// TestWire: a message this client encodes decodes with its signature
// checked; one signed with another key, or altered, is refused.
func TestWire(t *testing.T) {
	s := signer{key: []byte("secret")}
	h := Header{MsgID: "m1", Session: "s", MsgType: "execute_request", Version: protocolVersion}
	frames, err := s.encode(h, map[string]string{"code": "1"})
	if err != nil {
		t.Fatal(err)
	}
	// A ROUTER's identity frames come first on the kernel's side.
	m, err := s.decode(append([][]byte{[]byte("identity")}, frames...))
	if err != nil || m.Header.MsgID != "m1" || string(m.Content) != `{"code":"1"}` {
		t.Fatalf("decode: %v %+v", err, m)
	}
	if _, err := (signer{key: []byte("other")}).decode(frames); err != errBadSignature {
		t.Errorf("another key: %v", err)
	}
	frames[5] = []byte(`{"code":"2"}`)
	if _, err := s.decode(frames); err != errBadSignature {
		t.Errorf("altered content: %v", err)
	}
	if _, err := s.decode(frames[:4]); err == nil {
		t.Error("a message of 4 frames decoded")
	}
}

// TestNonFinite: Python's NaN and Infinity become null, inside strings
// they stay.
func TestNonFinite(t *testing.T) {
	var v map[string]any
	in := `{"a": NaN, "b": [Infinity, -Infinity, 1], "c": "NaN \" Infinity"}`
	if err := unmarshal([]byte(in), &v); err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(v)
	if string(b) != `{"a":null,"b":[null,null,1],"c":"NaN \" Infinity"}` {
		t.Errorf("got %s", b)
	}
}

// TestFindSpec: a kernelspec is read by name from the first directory that
// has it; names that are paths are refused.
func TestFindSpec(t *testing.T) {
	if _, err := FindSpec("../etc", []string{t.TempDir()}); err == nil {
		t.Error("a name with a slash was looked up")
	}
	if _, err := FindSpec("python3", []string{t.TempDir()}); err == nil {
		t.Error("found a kernelspec in an empty directory")
	}
}
