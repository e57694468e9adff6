package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"path"
	"sort"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/api/gen/filesystem/filesystemconnect"
)

// filesystemService serves filesystem.Filesystem and /files. Every path goes
// through fsRoot (fsresolve.go), so nothing outside the sandbox root is ever
// read, written, listed or removed, and every operation runs as the
// requesting user (creds.go), so nothing that user may not touch is either.
type filesystemService struct {
	s *Server

	mu       sync.Mutex
	watchers map[string]*pollWatcher
}

var _ filesystemconnect.FilesystemHandler = (*filesystemService)(nil)

func newFilesystemService(s *Server) *filesystemService {
	return &filesystemService{s: s, watchers: map[string]*pollWatcher{}}
}

// maxWalkDepth bounds how deep ListDir descends, whatever the request asks.
const maxWalkDepth = 1024

func (f *filesystemService) openRoot() (*fsRoot, error) {
	r, err := openFSRoot(f.s.cfg.Root)
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, errors.New("sandbox root is not available"))
	}
	return r, nil
}

// target resolves a requested path for the user a request acts as.
func (f *filesystemService) target(h http.Header, raw string) (User, string, error) {
	u, err := f.s.requestUser(h)
	if err != nil {
		return User{}, "", err
	}
	p, err := sandboxPath(raw, u)
	if err != nil {
		return User{}, "", connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("invalid path %q: %v", raw, err))
	}
	return u, p, nil
}

// resolve is target plus the sandbox root to resolve the path under; the
// caller closes the root.
func (f *filesystemService) resolve(h http.Header, raw string) (User, string, *fsRoot, error) {
	u, p, err := f.target(h, raw)
	if err != nil {
		return User{}, "", nil, err
	}
	r, err := f.openRoot()
	if err != nil {
		return User{}, "", nil, err
	}
	return u, p, r, nil
}

// do resolves raw for a request and runs op on it as the request's user
// (see asUser). Errors from op are reported as operation what on the path.
// Entries made by op name owners from the account files as read here,
// before the switch, by the agent.
func (f *filesystemService) do(ctx context.Context, h http.Header, raw, what string, op func(p string, e *entries) error) error {
	u, p, r, err := f.resolve(h, raw)
	if err != nil {
		return err
	}
	defer r.Close()
	e := f.newEntries(r)
	if err := f.s.asUser(ctx, u, func() error { return op(p, e) }); err != nil {
		return fsError(what, p, err)
	}
	return nil
}

// entry describes p after an operation on it.
func (e *entries) entryOf(p string) (*pb.EntryInfo, error) {
	en, err := e.stat(p)
	if err != nil {
		return nil, fsError("stat", p, err)
	}
	return en, nil
}

func (f *filesystemService) Stat(ctx context.Context, req *connect.Request[pb.StatRequest]) (*connect.Response[pb.StatResponse], error) {
	var e *pb.EntryInfo
	err := f.do(ctx, req.Header(), req.Msg.GetPath(), "stat", func(p string, en *entries) (err error) {
		e, err = en.entryOf(p)
		return err
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.StatResponse{Entry: e}), nil
}

func (f *filesystemService) MakeDir(ctx context.Context, req *connect.Request[pb.MakeDirRequest]) (*connect.Response[pb.MakeDirResponse], error) {
	var e *pb.EntryInfo
	err := f.do(ctx, req.Header(), req.Msg.GetPath(), "make directory", func(p string, en *entries) error {
		r := en.r
		if fd, err := r.open(p, unix.O_PATH, 0); err == nil {
			var st unix.Stat_t
			err = unix.Fstat(fd, &st)
			unix.Close(fd)
			if err == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR {
				return connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("directory %q already exists", p))
			}
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path %q already exists and is not a directory", p))
		} else if err != unix.ENOENT {
			return err
		}
		fd, _, err := r.mkdirAll(p)
		if err != nil {
			return err
		}
		unix.Close(fd)
		e, err = en.entryOf(p)
		return err
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.MakeDirResponse{Entry: e}), nil
}

func (f *filesystemService) Move(ctx context.Context, req *connect.Request[pb.MoveRequest]) (*connect.Response[pb.MoveResponse], error) {
	_, src, err := f.target(req.Header(), req.Msg.GetSource())
	if err != nil {
		return nil, err
	}
	var e *pb.EntryInfo
	err = f.do(ctx, req.Header(), req.Msg.GetDestination(), fmt.Sprintf("move %q to", src), func(dst string, en *entries) error {
		r := en.r
		if _, err := r.lstat(src); err != nil {
			return fsError("move", src, err)
		}
		if err := r.rename(src, dst); err != nil {
			return err
		}
		e, err = en.entryOf(dst)
		return err
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.MoveResponse{Entry: e}), nil
}

// Remove removes a file, a symlink or a directory tree. A path that does not
// exist is removed already: success, as on E2B.
func (f *filesystemService) Remove(ctx context.Context, req *connect.Request[pb.RemoveRequest]) (*connect.Response[pb.RemoveResponse], error) {
	err := f.do(ctx, req.Header(), req.Msg.GetPath(), "remove", func(p string, en *entries) error {
		if err := en.r.removeAll(p); !errors.Is(err, unix.ENOENT) {
			return err
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.RemoveResponse{}), nil
}

func (f *filesystemService) ListDir(ctx context.Context, req *connect.Request[pb.ListDirRequest]) (*connect.Response[pb.ListDirResponse], error) {
	depth := int(min(max(req.Msg.GetDepth(), 1), maxWalkDepth))
	var out []*pb.EntryInfo
	err := f.do(ctx, req.Header(), req.Msg.GetPath(), "list", func(p string, en *entries) error {
		fd, err := en.r.open(p, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err == unix.ENOTDIR {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path %q is not a directory", p))
		}
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		w := walker{ctx: ctx, e: en, out: []*pb.EntryInfo{}}
		err = w.walk(fd, p, depth)
		out = w.out
		return err
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.ListDirResponse{Entries: out}), nil
}

// walker lists a tree depth first, in name order, through descriptors opened
// without following symlinks: a symlinked directory is listed, not entered.
type walker struct {
	ctx context.Context
	e   *entries
	out []*pb.EntryInfo
}

func (w *walker) walk(dirfd int, dir string, depth int) error {
	if err := w.ctx.Err(); err != nil {
		return err
	}
	names, err := readDirNames(dirfd, int(^uint(0)>>1))
	if err != nil {
		return err
	}
	sort.Strings(names)
	for _, name := range names {
		var st unix.Stat_t
		if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			continue // gone since it was read
		}
		p := path.Join(dir, name)
		raw := ""
		if st.Mode&unix.S_IFMT == unix.S_IFLNK {
			raw, _ = readlinkAt(dirfd, name)
		}
		en := w.e.entry(p, &st, raw)
		en.Metadata = readMetadata(dirfd, name, st.Mode)
		w.out = append(w.out, en)
		if depth <= 1 || st.Mode&unix.S_IFMT != unix.S_IFDIR {
			continue
		}
		cfd, err := openBeneath(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY)
		if err != nil {
			continue // swapped for a symlink, removed, or unreadable
		}
		err = w.walk(cfd, p, depth-1)
		unix.Close(cfd)
		if err != nil {
			return err
		}
	}
	return nil
}

// entries builds EntryInfo messages, naming owners and groups from the
// account files as they were when it was made.
type entries struct {
	r             *fsRoot
	passwd, group *accounts // nil when unreadable: ids are shown as numbers
}

func (f *filesystemService) newEntries(r *fsRoot) *entries {
	passwd, _ := loadAccounts(f.s.cfg.Passwd)
	group, _ := loadAccounts(f.s.cfg.Group)
	return &entries{r: r, passwd: passwd, group: group}
}

// stat describes sandbox path p, not following its final component.
func (e *entries) stat(p string) (*pb.EntryInfo, error) {
	st, err := e.r.lstat(p)
	if err != nil {
		return nil, err
	}
	raw := ""
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		raw, _ = e.r.readlink(p)
	}
	en := e.entry(p, &st, raw)
	en.Metadata = e.r.metadata(p, st.Mode)
	return en, nil
}

func (e *entries) entry(p string, st *unix.Stat_t, rawTarget string) *pb.EntryInfo {
	mode := fileMode(st.Mode)
	info := &pb.EntryInfo{
		Name:         path.Base(p),
		Path:         p,
		Size:         st.Size,
		Mode:         uint32(mode.Perm()),
		Permissions:  mode.String(),
		Owner:        e.passwd.name(st.Uid),
		Group:        e.group.name(st.Gid),
		ModifiedTime: timestamppb.New(time.Unix(st.Mtim.Sec, st.Mtim.Nsec)),
	}
	switch {
	case mode.IsRegular():
		info.Type = pb.FileType_FILE_TYPE_FILE
	case mode.IsDir():
		info.Type = pb.FileType_FILE_TYPE_DIRECTORY
	case mode&fs.ModeSymlink != 0:
		info.Type = pb.FileType_FILE_TYPE_SYMLINK
		target := e.r.linkTarget(p, rawTarget)
		info.SymlinkTarget = &target
	}
	return info
}

// fileMode converts a stat(2) mode to Go's fs.FileMode.
func fileMode(m uint32) fs.FileMode {
	mode := fs.FileMode(m & 0o777)
	switch m & unix.S_IFMT {
	case unix.S_IFDIR:
		mode |= fs.ModeDir
	case unix.S_IFLNK:
		mode |= fs.ModeSymlink
	case unix.S_IFIFO:
		mode |= fs.ModeNamedPipe
	case unix.S_IFSOCK:
		mode |= fs.ModeSocket
	case unix.S_IFCHR:
		mode |= fs.ModeDevice | fs.ModeCharDevice
	case unix.S_IFBLK:
		mode |= fs.ModeDevice
	}
	if m&unix.S_ISUID != 0 {
		mode |= fs.ModeSetuid
	}
	if m&unix.S_ISGID != 0 {
		mode |= fs.ModeSetgid
	}
	if m&unix.S_ISVTX != 0 {
		mode |= fs.ModeSticky
	}
	return mode
}

// errnoCode maps a syscall error to a Connect code.
func errnoCode(err error) connect.Code {
	var errno unix.Errno
	switch {
	case errors.Is(err, errNoPath), errors.Is(err, errRootPath):
		return connect.CodeInvalidArgument
	case errors.Is(err, context.Canceled):
		return connect.CodeCanceled
	case errors.Is(err, context.DeadlineExceeded):
		return connect.CodeDeadlineExceeded
	case !errors.As(err, &errno):
		return connect.CodeInternal
	}
	switch errno {
	case unix.ENOENT:
		return connect.CodeNotFound
	case unix.EEXIST:
		return connect.CodeAlreadyExists
	case unix.EACCES, unix.EPERM, unix.EROFS:
		return connect.CodePermissionDenied
	case unix.ENOSPC, unix.EDQUOT, unix.EMFILE, unix.ENFILE:
		return connect.CodeResourceExhausted
	case unix.ENOTDIR, unix.EISDIR, unix.EINVAL, unix.ELOOP, unix.ENAMETOOLONG, unix.EXDEV:
		return connect.CodeInvalidArgument
	case unix.ENOTEMPTY, unix.EBUSY:
		return connect.CodeFailedPrecondition
	}
	return connect.CodeInternal
}

// fsError turns err from operation op on sandbox path p into a one-line
// Connect error. Messages name sandbox paths only.
func fsError(op, p string, err error) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return err
	}
	msg := err.Error()
	var errno unix.Errno
	if errors.As(err, &errno) {
		msg = errno.Error()
	}
	return connect.NewError(errnoCode(err), fmt.Errorf("%s %q: %s", op, p, msg))
}
