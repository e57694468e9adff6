package daemontest

import (
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestVolumeDeleteWhileUploading: a volume that a content request holds
// (an upload in progress) is not deleted under it: 409, the volume and
// the upload's file still there; once the request ends, the delete goes
// through. Found by review, 2026-12-04: the delete unlinked the image
// under the upload, whose file system, and the image's blocks on the
// host's disk, stayed as long as the upload lasted (an hour), outside the
// key's volumes: fill a volume through an upload kept alive, delete it,
// make another, again.
func TestVolumeDeleteWhileUploading(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	v := d.createVolume(t, d.key, "held")
	c, err := net.Dial("tcp", d.api)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	head := "PUT /volumecontent/" + v.VolumeID + "/file?path=/big HTTP/1.1\r\nHost: x\r\n" +
		"Content-Type: application/octet-stream\r\nAuthorization: Bearer " + v.Token + "\r\n" +
		"Content-Length: " + strconv.Itoa(8<<20) + "\r\n\r\n"
	if _, err := c.Write([]byte(head + strings.Repeat("x", 1<<20))); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond) // the request is in its handler
	r := d.expect(t, http.StatusConflict, call{method: "DELETE", path: "/volumes/" + v.VolumeID, key: d.key})
	if !strings.Contains(string(r.body), "content request") {
		t.Errorf("the refusal %s does not say why", r.body)
	}
	d.expect(t, http.StatusOK, call{method: "GET", path: "/volumes/" + v.VolumeID, key: d.key})
	c.Close() // the upload ends (nothing of it is kept)
	deadline := time.Now().Add(10 * time.Second)
	for {
		r := d.do(t, call{method: "DELETE", path: "/volumes/" + v.VolumeID, key: d.key})
		if r.status == http.StatusNoContent {
			break
		}
		if r.status != http.StatusConflict || time.Now().After(deadline) {
			t.Fatalf("delete once the upload ended: %v", r)
		}
		time.Sleep(100 * time.Millisecond)
	}
	d.expect(t, http.StatusNotFound, call{method: "GET", path: "/volumes/" + v.VolumeID, key: d.key})
}
