package daemontest

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
)

// TestVolumeUploadIdleBound: once a volume's token is checked, an upload
// may take up to an hour only while its body keeps coming. One that sends
// 1 KiB of a declared 1 MiB and then nothing is ended (its connection
// closed) about a minute later, where it held the connection for the hour;
// one that sends a byte every 25 s, slower than the listener's minute in
// all, is not cut and its file is written. Found by review, 2026-12-03: a
// token holder could keep its address's 4,096 connections for an hour with
// nothing sent.
func TestVolumeUploadIdleBound(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	v := d.createVolume(t, d.key, "idle")
	defer d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/volumes/" + v.VolumeID, key: d.key})
	head := func(path string, length int) string {
		return "PUT /volumecontent/" + v.VolumeID + "/file?path=" + path + " HTTP/1.1\r\nHost: x\r\n" +
			"Content-Type: application/octet-stream\r\nAuthorization: Bearer " + v.Token + "\r\n" +
			"Content-Length: " + strconv.Itoa(length) + "\r\n\r\n"
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // stalled: ended by the server
		defer wg.Done()
		c, err := net.Dial("tcp", d.api)
		if err != nil {
			t.Error(err)
			return
		}
		defer c.Close()
		if _, err := c.Write([]byte(head("/stalled", 1<<20) + strings.Repeat("x", 1024))); err != nil {
			t.Error(err)
			return
		}
		_ = c.SetReadDeadline(time.Now().Add(4 * time.Minute)) // a hang guard: the bound is a minute
		_, err = io.Copy(io.Discard, c)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("a stalled upload's connection is still open after 4 minutes")
		}
	}()
	go func() { // slow but moving: served
		defer wg.Done()
		c, err := net.Dial("tcp", d.api)
		if err != nil {
			t.Error(err)
			return
		}
		defer c.Close()
		body := "slow!"
		if _, err := c.Write([]byte(head("/slow", len(body)))); err != nil {
			t.Error(err)
			return
		}
		for i := range len(body) {
			if i > 0 {
				time.Sleep(25 * time.Second)
			}
			if _, err := c.Write([]byte(body[i : i+1])); err != nil {
				t.Errorf("the slow upload's byte %d: %v", i, err)
				return
			}
		}
		_ = c.SetReadDeadline(time.Now().Add(time.Minute))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil || resp.StatusCode != http.StatusCreated {
			t.Errorf("a slow upload that kept moving: %v %v", resp, err)
		}
	}()
	wg.Wait()
	var list []types.VolumeEntryStat
	d.content(t, "GET", v.VolumeID, v.Token, "dir", q("path", "/"), nil).decode(t, &list)
	if len(list) != 1 || list[0].Name != "slow" || list[0].Size != 5 {
		t.Errorf("the volume holds %+v, want the slow upload's file alone", list)
	}
}
