package agent

import (
	"net/http"

	"github.com/cagehq/cage/api/gen/filesystem/filesystemconnect"
)

// filesystemService is being written; this placeholder keeps the package building.
type filesystemService struct {
	filesystemconnect.UnimplementedFilesystemHandler
	s *Server
}

func newFilesystemService(s *Server) *filesystemService { return &filesystemService{s: s} }

func (f *filesystemService) serveDownload(w http.ResponseWriter, r *http.Request) {}
func (f *filesystemService) serveUpload(w http.ResponseWriter, r *http.Request)   {}
