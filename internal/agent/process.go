package agent

import "github.com/cagehq/cage/api/gen/process/processconnect"

// processService is being written; this placeholder keeps the package building.
type processService struct {
	processconnect.UnimplementedProcessHandler
	s *Server
}

func newProcessService(s *Server) *processService { return &processService{s: s} }

func (p *processService) killAll() {}
