package agent

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	pb "github.com/cagehq/cage/api/gen/filesystem"
)

// Directory watching with inotify. A watch holds the watched directory open
// (resolved in the root) and adds each inotify watch on /proc/self/fd/<fd>
// of a directory descriptor, so the kernel watches exactly the directory the
// resolver found. Subdirectories are opened beneath that descriptor without
// following symlinks: a recursive watch never wanders out of the tree. Every
// directory is opened, watched and listed, and every entry described, as the
// requesting user (asUser): a watch sees only what that user may read.

const (
	// watchMask is what each watched directory reports.
	watchMask = unix.IN_CREATE | unix.IN_MOVED_TO | unix.IN_MOVED_FROM | unix.IN_MODIFY |
		unix.IN_ATTRIB | unix.IN_DELETE | unix.IN_ONLYDIR
	inotifyHeader = 16 // sizeof(struct inotify_event) without the name

	defaultKeepalive = 50 * time.Second
	keepaliveHeader  = "Keepalive-Ping-Interval"

	// maxWatcherEvents bounds a polling watcher's buffer; the oldest go first.
	maxWatcherEvents = 10000
)

// dirWatch is one inotify instance watching a directory (and, when
// recursive, every directory below it).
type dirWatch struct {
	s         *Server
	u         User // whom the watch acts as
	r         *fsRoot
	e         *entries
	base      string // sandbox path of the watched directory
	baseFd    int    // O_RDONLY descriptor of it
	recursive bool
	withEntry bool

	ino    *os.File
	raw    syscall.RawConn  // the inotify fd, held safely against Close
	paths  map[int32]string // watch descriptor → directory relative to base
	temps  map[uint32]bool  // cookies of upload temp files being renamed
	ctx    context.Context  // ends with Close: a wait for a file worker ends
	cancel context.CancelFunc
	stop   sync.Once
	done   chan struct{} // closed once run has returned and fds are released
}

// watchDir starts watching sandbox path p as u. It takes ownership of r.
func (f *filesystemService) watchDir(ctx context.Context, u User, r *fsRoot, p string, recursive, withEntry bool) (*dirWatch, error) {
	w := &dirWatch{s: f.s, u: u, r: r, e: f.newEntries(r), base: p, baseFd: -1, recursive: recursive,
		withEntry: withEntry, paths: map[int32]string{}, temps: map[uint32]bool{}, done: make(chan struct{})}
	w.ctx, w.cancel = context.WithCancel(context.Background())
	err := f.s.asUser(ctx, u, func() error {
		fd, err := r.open(p, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err == unix.ENOTDIR {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path %q is not a directory", p))
		}
		if err != nil {
			return err
		}
		w.baseFd = fd
		ifd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
		if err != nil {
			return err
		}
		w.ino = os.NewFile(uintptr(ifd), "inotify")
		if w.raw, err = w.ino.SyscallConn(); err != nil {
			return err
		}
		return w.add(fd, "")
	})
	if err == nil && recursive {
		if !w.walk("", nil) {
			err = w.ctx.Err()
			if err == nil {
				err = errors.New("the watch ended while it was being set up")
			}
		}
	}
	if err != nil {
		w.release()
		return nil, fsError("watch", p, err)
	}
	return w, nil
}

// release frees everything the watch holds.
func (w *dirWatch) release() {
	w.cancel()
	if w.ino != nil {
		w.ino.Close()
	}
	if w.baseFd >= 0 {
		unix.Close(w.baseFd)
	}
	w.r.Close()
}

// Close stops the watch; its descriptors are released once run returns.
func (w *dirWatch) Close() {
	w.stop.Do(func() {
		w.cancel()
		w.ino.Close()
	})
}

// inotify runs fn on the inotify descriptor unless the watch is closed.
func (w *dirWatch) inotify(fn func(ifd int) error) error {
	var err error
	if cerr := w.raw.Control(func(ifd uintptr) { err = fn(int(ifd)) }); cerr != nil {
		return cerr
	}
	return err
}

// add watches the directory open as fd, which is rel below the base. The
// watch goes on /proc/self/fd/<fd>, a magic link the kernel resolves to
// exactly that directory; fd itself came from the in-root resolver.
func (w *dirWatch) add(fd int, rel string) error {
	return w.inotify(func(ifd int) error {
		wd, err := unix.InotifyAddWatch(ifd, "/proc/self/fd/"+strconv.Itoa(fd), watchMask)
		if err == nil {
			w.paths[int32(wd)] = rel
		}
		return err
	})
}

// walk watches the directory rel below the base (unless it is the base,
// watched already) and every directory below it, one directory at a time,
// each as the user. With emit set, it also reports each entry found as
// created (and a file with content as written): they may have appeared, and
// been written, before the watch was in place. It returns false when emit
// did or the watch ended.
func (w *dirWatch) walk(rel string, emit func(*pb.FilesystemEvent) bool) bool {
	pending := []string{rel}
	for len(pending) > 0 {
		dir := pending[len(pending)-1]
		pending = pending[:len(pending)-1]
		var evs []*pb.FilesystemEvent
		var subs []string
		err := w.s.asUser(w.ctx, w.u, func() error {
			fd := w.baseFd
			if dir != "" {
				var err error
				if fd, err = openBeneath(w.baseFd, dir, unix.O_RDONLY|unix.O_DIRECTORY); err != nil {
					return nil // gone, swapped for a symlink, or not the user's to read
				}
				defer unix.Close(fd)
				if w.add(fd, dir) != nil {
					return nil
				}
			}
			evs, subs = w.scan(fd, dir, emit != nil)
			return nil
		})
		if err != nil {
			return false
		}
		for _, ev := range evs {
			if !emit(ev) {
				return false
			}
		}
		pending = append(pending, subs...)
	}
	return true
}

// scan lists the directory open as fd (rel below the base): its
// subdirectories, and with events set what walk reports of its entries.
func (w *dirWatch) scan(fd int, rel string, events bool) ([]*pb.FilesystemEvent, []string) {
	names, err := readDirNames(fd, int(^uint(0)>>1))
	if err != nil {
		return nil, nil
	}
	var evs []*pb.FilesystemEvent
	var subs []string
	for _, name := range names {
		child := path.Join(rel, name)
		if events {
			evs = append(evs, w.event(child, pb.EventType_EVENT_TYPE_CREATE))
		}
		var st unix.Stat_t
		if unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
			continue
		}
		if events && st.Mode&unix.S_IFMT == unix.S_IFREG && st.Size > 0 {
			evs = append(evs, w.event(child, pb.EventType_EVENT_TYPE_WRITE))
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			subs = append(subs, child)
		}
	}
	return evs, subs
}

// forget drops the watches for rel and everything below it.
func (w *dirWatch) forget(rel string) {
	for wd, p := range w.paths {
		if p == rel || strings.HasPrefix(p, rel+"/") {
			_ = w.inotify(func(ifd int) error {
				_, err := unix.InotifyRmWatch(ifd, uint32(wd))
				return err
			})
			delete(w.paths, wd)
		}
	}
}

func (w *dirWatch) event(rel string, t pb.EventType) *pb.FilesystemEvent {
	ev := &pb.FilesystemEvent{Name: rel, Type: t}
	if w.withEntry && t != pb.EventType_EVENT_TYPE_REMOVE && t != pb.EventType_EVENT_TYPE_RENAME {
		if e, err := w.e.stat(path.Join(w.base, rel)); err == nil {
			ev.Entry = e
		}
	}
	return ev
}

// run reads events and hands them to emit until Close, until emit returns
// false, or until the watched directory is gone. It then releases the watch.
func (w *dirWatch) run(emit func(*pb.FilesystemEvent) bool) {
	defer close(w.done)
	defer w.release()
	buf := make([]byte, 64<<10)
	for {
		n, err := w.ino.Read(buf)
		if err != nil {
			return
		}
		evs := parseInotify(buf[:n])
		w.e = w.s.files.newEntries(w.r) // account files as they are now
		var out []*pb.FilesystemEvent
		var dirs []string
		end := false
		handle := func() error {
			out, dirs, end = w.handle(evs)
			return nil
		}
		if w.needsFiles(evs) {
			if w.s.asUser(w.ctx, w.u, handle) != nil {
				return
			}
		} else {
			_ = handle()
		}
		for _, ev := range out {
			if !emit(ev) {
				return
			}
		}
		for _, d := range dirs {
			if !w.walk(d, emit) {
				return
			}
		}
		if end {
			return
		}
	}
}

type inotifyEvent struct {
	wd           int32
	mask, cookie uint32
	name         string
}

// parseInotify splits what a read of an inotify descriptor returned.
func parseInotify(buf []byte) []inotifyEvent {
	var evs []inotifyEvent
	for off := 0; off+inotifyHeader <= len(buf); {
		ev := inotifyEvent{
			wd:     int32(binary.NativeEndian.Uint32(buf[off:])),
			mask:   binary.NativeEndian.Uint32(buf[off+4:]),
			cookie: binary.NativeEndian.Uint32(buf[off+8:]),
		}
		end := min(off+inotifyHeader+int(binary.NativeEndian.Uint32(buf[off+12:])), len(buf))
		ev.name = strings.TrimRight(string(buf[off+inotifyHeader:end]), "\x00")
		off = end
		evs = append(evs, ev)
	}
	return evs
}

// needsFiles reports whether handling evs touches files: to describe
// entries, or to find new directories of a recursive watch.
func (w *dirWatch) needsFiles(evs []inotifyEvent) bool {
	if w.withEntry {
		return true
	}
	for _, ev := range evs {
		if w.recursive && ev.mask&unix.IN_ISDIR != 0 && ev.mask&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0 {
			return true
		}
	}
	return false
}

// handle turns inotify events into filesystem events and lists the
// directories that appeared in a recursive watch (to walk); end is set when
// the watched directory itself is gone.
func (w *dirWatch) handle(evs []inotifyEvent) (out []*pb.FilesystemEvent, dirs []string, end bool) {
	for _, ev := range evs {
		rel, ok := w.paths[ev.wd]
		if ev.mask&unix.IN_IGNORED != 0 {
			delete(w.paths, ev.wd)
			if ok && rel == "" {
				return out, dirs, true
			}
			continue
		}
		if !ok || ev.name == "" {
			continue // queue overflow, or an event about a directory itself
		}
		child := path.Join(rel, ev.name)
		mask := ev.mask
		if strings.HasPrefix(ev.name, uploadTempPrefix) {
			// An upload in progress: report it when it lands, under its name.
			if mask&unix.IN_MOVED_FROM != 0 {
				if len(w.temps) > 64 {
					clear(w.temps)
				}
				w.temps[ev.cookie] = true
			}
			continue
		}
		if mask&unix.IN_MOVED_TO != 0 && w.temps[ev.cookie] {
			delete(w.temps, ev.cookie)
			mask |= unix.IN_MODIFY
		}
		for _, t := range eventTypes(mask) {
			out = append(out, w.event(child, t))
		}
		if w.recursive && mask&unix.IN_ISDIR != 0 {
			switch {
			case mask&(unix.IN_MOVED_FROM|unix.IN_DELETE) != 0:
				w.forget(child)
				dirs = slices.DeleteFunc(dirs, func(d string) bool { return d == child || strings.HasPrefix(d, child+"/") })
			case mask&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0:
				dirs = append(dirs, child)
			}
		}
	}
	return out, dirs, false
}

// eventTypes lists the E2B event types an inotify mask stands for.
func eventTypes(mask uint32) []pb.EventType {
	var ts []pb.EventType
	if mask&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0 {
		ts = append(ts, pb.EventType_EVENT_TYPE_CREATE)
	}
	if mask&unix.IN_MOVED_FROM != 0 {
		ts = append(ts, pb.EventType_EVENT_TYPE_RENAME)
	}
	if mask&unix.IN_ATTRIB != 0 {
		ts = append(ts, pb.EventType_EVENT_TYPE_CHMOD)
	}
	if mask&unix.IN_MODIFY != 0 {
		ts = append(ts, pb.EventType_EVENT_TYPE_WRITE)
	}
	if mask&unix.IN_DELETE != 0 {
		ts = append(ts, pb.EventType_EVENT_TYPE_REMOVE)
	}
	return ts
}

// startWatch resolves a watch request and starts the watch.
func (f *filesystemService) startWatch(ctx context.Context, h http.Header, raw string, recursive, withEntry bool) (*dirWatch, error) {
	u, p, r, err := f.resolve(h, raw)
	if err != nil {
		return nil, err
	}
	return f.watchDir(ctx, u, r, p, recursive, withEntry)
}

func keepaliveInterval(h http.Header) time.Duration {
	if n, err := strconv.Atoi(h.Get(keepaliveHeader)); err == nil && n > 0 {
		return time.Duration(n) * time.Second
	}
	return defaultKeepalive
}

func (f *filesystemService) WatchDir(ctx context.Context, req *connect.Request[pb.WatchDirRequest], stream *connect.ServerStream[pb.WatchDirResponse]) error {
	w, err := f.startWatch(ctx, req.Header(), req.Msg.GetPath(), req.Msg.GetRecursive(), req.Msg.GetIncludeEntry())
	if err != nil {
		return err
	}
	events := make(chan *pb.FilesystemEvent, 256)
	go w.run(func(ev *pb.FilesystemEvent) bool {
		select {
		case events <- ev:
			return true
		case <-ctx.Done():
			return false
		}
	})
	defer func() { w.Close(); <-w.done }()
	start := &pb.WatchDirResponse{Event: &pb.WatchDirResponse_Start{Start: &pb.WatchDirResponse_StartEvent{}}}
	if err := stream.Send(start); err != nil {
		return err
	}
	every := keepaliveInterval(req.Header())
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev := <-events:
			if err := sendEvent(stream, ev); err != nil {
				return err
			}
			tick.Reset(every)
		case <-w.done:
			for {
				select {
				case ev := <-events:
					if err := sendEvent(stream, ev); err != nil {
						return err
					}
				default:
					return nil
				}
			}
		case <-tick.C:
			ka := &pb.WatchDirResponse{Event: &pb.WatchDirResponse_Keepalive{Keepalive: &pb.WatchDirResponse_KeepAlive{}}}
			if err := stream.Send(ka); err != nil {
				return err
			}
		}
	}
}

func sendEvent(stream *connect.ServerStream[pb.WatchDirResponse], ev *pb.FilesystemEvent) error {
	return stream.Send(&pb.WatchDirResponse{Event: &pb.WatchDirResponse_Filesystem{Filesystem: ev}})
}
