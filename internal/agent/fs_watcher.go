package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"

	"connectrpc.com/connect"

	pb "github.com/cagehq/cage/api/gen/filesystem"
)

// The polling watchers (CreateWatcher, GetWatcherEvents, RemoveWatcher): a
// dirWatch whose events wait in a bounded buffer until the client asks.

// pollWatcher buffers a watch's events for GetWatcherEvents.
type pollWatcher struct {
	w      *dirWatch
	mu     sync.Mutex
	events []*pb.FilesystemEvent
}

func (p *pollWatcher) push(ev *pb.FilesystemEvent) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.events) >= maxWatcherEvents {
		p.events[0] = nil
		p.events = p.events[1:]
	}
	p.events = append(p.events, ev)
	return true
}

func (p *pollWatcher) take() []*pb.FilesystemEvent {
	p.mu.Lock()
	defer p.mu.Unlock()
	evs := p.events
	p.events = nil
	if evs == nil {
		evs = []*pb.FilesystemEvent{}
	}
	return evs
}

func (f *filesystemService) CreateWatcher(ctx context.Context, req *connect.Request[pb.CreateWatcherRequest]) (*connect.Response[pb.CreateWatcherResponse], error) {
	w, err := f.startWatch(ctx, req.Header(), req.Msg.GetPath(), req.Msg.GetRecursive(), req.Msg.GetIncludeEntry())
	if err != nil {
		return nil, err
	}
	pw := &pollWatcher{w: w}
	var b [12]byte
	if _, err := rand.Read(b[:]); err != nil {
		w.release()
		return nil, connect.NewError(connect.CodeInternal, errors.New("cannot generate a watcher id"))
	}
	id := "w" + hex.EncodeToString(b[:])
	f.mu.Lock()
	f.watchers[id] = pw
	f.mu.Unlock()
	go w.run(pw.push)
	return connect.NewResponse(&pb.CreateWatcherResponse{WatcherId: id}), nil
}

func (f *filesystemService) watcher(id string) (*pollWatcher, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	pw, ok := f.watchers[id]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %q not found", id))
	}
	return pw, nil
}

func (f *filesystemService) GetWatcherEvents(ctx context.Context, req *connect.Request[pb.GetWatcherEventsRequest]) (*connect.Response[pb.GetWatcherEventsResponse], error) {
	pw, err := f.watcher(req.Msg.GetWatcherId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.GetWatcherEventsResponse{Events: pw.take()}), nil
}

func (f *filesystemService) RemoveWatcher(ctx context.Context, req *connect.Request[pb.RemoveWatcherRequest]) (*connect.Response[pb.RemoveWatcherResponse], error) {
	id := req.Msg.GetWatcherId()
	pw, err := f.watcher(id)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	delete(f.watchers, id)
	f.mu.Unlock()
	pw.w.Close()
	<-pw.w.done
	return connect.NewResponse(&pb.RemoveWatcherResponse{}), nil
}

// closeWatchers stops every polling watcher (on shutdown).
func (f *filesystemService) closeWatchers() {
	f.mu.Lock()
	ws := f.watchers
	f.watchers = map[string]*pollWatcher{}
	f.mu.Unlock()
	for _, pw := range ws {
		pw.w.Close()
		<-pw.w.done
	}
}
