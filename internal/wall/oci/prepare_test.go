package oci

import (
	"fmt"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestOnOwnThread: fn never runs on the process's main thread (which Go
// keeps, changed, when a goroutine locked to it ends), and each run's
// thread ends with it.
func TestOnOwnThread(t *testing.T) {
	for range 200 {
		tid := 0
		onOwnThread(func() { tid = unix.Gettid() })
		if tid == unix.Getpid() {
			t.Fatal("fn ran on the main thread")
		}
		for i := 0; ; i++ { // the thread's exit follows the goroutine's
			if _, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", tid)); os.IsNotExist(err) {
				break
			}
			if i == 1000 {
				t.Fatalf("thread %d outlived its run", tid)
			}
			time.Sleep(time.Millisecond)
		}
	}
}
