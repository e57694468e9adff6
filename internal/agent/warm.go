package agent

import (
	"google.golang.org/protobuf/proto"

	pb "github.com/cagehq/cage/api/gen/process"
)

// WarmProtocol has the protobuf runtime build now the tables it otherwise
// builds at first use (each message type's coders, its file's
// descriptors): those of a process start request, of the events that
// answer it and of closing its stdin. A sandbox's first command paid for
// them on the way to its first output (about 1 ms of CPU on either side).
// `cage run` runs this while its sandbox is made. The agent does not: the
// tables stay in its heap (about 60 KiB), which a sandbox that never runs
// a command would carry for nothing, and no gain showed in whole-process
// measurements. The messages are the process's own: nothing is read or
// sent.
func WarmProtocol() {
	s, yes := "x", true
	roundTrip(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: s, Args: []string{s}, Envs: map[string]string{s: s}, Cwd: &s},
		Pty: &pb.PTY{Size: &pb.PTY_Size{Cols: 1, Rows: 1}}, Tag: &s, Stdin: &yes, TimeoutMs: 1, MaxOutputBytes: 1}, &pb.StartRequest{})
	roundTrip(&pb.CloseStdinRequest{Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: 1}}}, &pb.CloseStdinRequest{})
	for _, ev := range []*pb.ProcessEvent{
		{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: 1}}},
		{Event: &pb.ProcessEvent_Data{Data: &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Stdout{Stdout: []byte(s)}}}},
		{Event: &pb.ProcessEvent_Data{Data: &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Stderr{Stderr: []byte(s)}}}},
		{Event: &pb.ProcessEvent_End{End: &pb.ProcessEvent_EndEvent{ExitCode: 1, Exited: true, Status: s, Error: &s, Reason: s, Truncated: true}}},
		{Event: &pb.ProcessEvent_Keepalive{Keepalive: &pb.ProcessEvent_KeepAlive{}}},
	} {
		roundTrip(&pb.StartResponse{Event: ev}, &pb.StartResponse{})
	}
}

func roundTrip(m, into proto.Message) {
	if b, err := proto.Marshal(m); err == nil {
		_ = proto.Unmarshal(b, into)
	}
}
