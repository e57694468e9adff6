package agentclient

import (
	"errors"
	"fmt"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// The agent is not trusted, and a message's size on the wire does not
// bound what it decodes to: an empty entry of a list is two bytes there
// and some 200 in the host's memory (a listing of 64 MiB of them took the
// daemon 100 times that). boundedCodec is Connect's binary codec with a
// bound on the items a message decodes to.

// maxItems bounds the items (nested messages, map entries, elements of
// repeated fields) one message from the agent may hold: some 200 bytes
// each at most, so at most about 13 MiB decoded, beside the message's
// own bytes. An honest agent's largest, a process list, holds a few per
// process and an environment's variables.
const maxItems = 1 << 16

// maxItemDepth bounds how deep the count descends (the agent's messages
// are at most three deep).
const maxItemDepth = 32

// errTooManyItems is countItems' error when the budget runs out.
var errTooManyItems = errors.New("the agent's answer holds too many items")

type boundedCodec struct{}

func (boundedCodec) Name() string { return "proto" }

func (boundedCodec) Marshal(m any) ([]byte, error) {
	pm, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("%T is not a proto.Message", m)
	}
	return proto.Marshal(pm)
}

func (boundedCodec) Unmarshal(b []byte, m any) error {
	pm, ok := m.(proto.Message)
	if !ok {
		return fmt.Errorf("%T is not a proto.Message", m)
	}
	budget := maxItems
	if err := countItems(b, pm.ProtoReflect().Descriptor(), &budget, 0); err != nil {
		return err
	}
	return proto.Unmarshal(b, pm)
}

// countItems spends budget on the items b, a message of md's type, would
// decode to, failing once it is spent. It reads the wire format only: a
// field md does not know is kept as its bytes (no item), as proto keeps
// unknown fields.
func countItems(b []byte, md protoreflect.MessageDescriptor, budget *int, depth int) error {
	if depth > maxItemDepth {
		return errors.New("the agent's answer is nested too deep")
	}
	spend := func(n int) error {
		if *budget -= n; *budget < 0 {
			return errTooManyItems
		}
		return nil
	}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		fd := md.Fields().ByNumber(num)
		if fd != nil && typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			switch {
			case fd.Kind() == protoreflect.MessageKind: // a map's entries are messages too
				if err := spend(1); err != nil {
					return err
				}
				if err := countItems(v, fd.Message(), budget, depth+1); err != nil {
					return err
				}
			case fd.IsList() && (fd.Kind() == protoreflect.StringKind || fd.Kind() == protoreflect.BytesKind):
				if err := spend(1); err != nil {
					return err
				}
			case fd.IsList(): // packed scalars: a byte or more each
				if err := spend(len(v)); err != nil {
					return err
				}
			}
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if fd != nil && fd.IsList() {
			if err := spend(1); err != nil {
				return err
			}
		}
	}
	return nil
}
