package network

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// A sandbox's tracked connections are found by the kernel: a dump of the
// connection table with a filter (CTA_FILTER, Linux 5.8 and later) sends
// back only the entries with the address at one end, and each is deleted
// by its tuple and id. Without the filter, every entry of the host's table
// crossed to this process, was decoded and compared here: on each
// sandbox's end, so with a thousand sandboxes alive and their flows (the
// proxy's to each, in TIME_WAIT for two minutes) it was the daemon's
// largest single cost (23% of its CPU over cage bench's serve rows:
// creates to 1,000 alive, bursts of creates and their kills). A kernel
// without the filter refuses it, and the table is walked here as before.

// ctnetlink constants (linux/netfilter/nfnetlink_conntrack.h and
// net/netfilter/nf_conntrack_netlink.c).
const (
	nfnlSubsysCTNetlink = 1
	ipctnlMsgCtNew      = 0
	ipctnlMsgCtGet      = 1
	ipctnlMsgCtDelete   = 2

	ctaTupleOrig  = 1
	ctaTupleReply = 2
	ctaID         = 12
	ctaZone       = 18
	ctaFilter     = 25

	ctaTupleIP   = 1
	ctaIPv4Src   = 1
	ctaIPv4Dst   = 2
	ctaFilterOrg = 1 // CTA_FILTER_ORIG_FLAGS
	ctaFilterRpl = 2 // CTA_FILTER_REPLY_FLAGS

	ctaFilterFIPSrc = 1 << 0 // CTA_FILTER_F_CTA_IP_SRC
	ctaFilterFIPDst = 1 << 1 // CTA_FILTER_F_CTA_IP_DST
)

// errNoKernelFilter says the kernel does not filter conntrack dumps.
var errNoKernelFilter = errors.New("the kernel does not filter conntrack dumps")

// errDumpInterrupted says the table changed under a dump: it is taken again.
var errDumpInterrupted = errors.New("conntrack: dump interrupted")

// deleteFlowsByKernel deletes every tracked IPv4 connection with ip at
// either end of either direction, the kernel choosing them. It returns
// errNoKernelFilter where the kernel cannot.
func deleteFlowsByKernel(ip netip.Addr) (int, error) {
	if !ip.Is4() {
		return 0, fmt.Errorf("conntrack: %s is not an IPv4 address", ip)
	}
	conn, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	a := ip.As4()
	deleted := 0
	// The four places the address can be: the original direction's source
	// (the sandbox's own connections) or destination (the proxy's and the
	// host's to it), the reply's (a translated connection).
	for _, w := range []struct{ tuple, ipAttr, flag uint16 }{
		{ctaTupleOrig, ctaIPv4Src, ctaFilterFIPSrc},
		{ctaTupleOrig, ctaIPv4Dst, ctaFilterFIPDst},
		{ctaTupleReply, ctaIPv4Src, ctaFilterFIPSrc},
		{ctaTupleReply, ctaIPv4Dst, ctaFilterFIPDst},
	} {
		flows, err := dumpFiltered(conn, w.tuple, w.ipAttr, w.flag, a)
		if err != nil {
			return deleted, err
		}
		for _, f := range flows {
			err := deleteFlow(conn, f)
			switch {
			case err == nil:
				deleted++
			case errors.Is(err, unix.ENOENT):
				// Gone since the dump (ended, or found in an earlier
				// direction's).
			default:
				return deleted, err
			}
		}
	}
	return deleted, nil
}

// ctFlow is what deleting one entry needs: its original tuple, id and
// zone as the kernel wrote them.
type ctFlow struct{ tuple, id, zone []byte }

func ctHeader(msg uint16, flags netlink.HeaderFlags) netlink.Header {
	return netlink.Header{Type: netlink.HeaderType(nfnlSubsysCTNetlink<<8 | msg), Flags: flags}
}

// nfgen is the nfgenmsg before a message's attributes: the IPv4 family,
// version 0, resource id 0.
var nfgen = []byte{unix.AF_INET, 0, 0, 0}

func dumpFiltered(conn *netlink.Conn, tuple, ipAttr, flag uint16, a [4]byte) ([]ctFlow, error) {
	ipEnc := netlink.NewAttributeEncoder()
	ipEnc.Bytes(ipAttr, a[:])
	ipb, err := ipEnc.Encode()
	if err != nil {
		return nil, err
	}
	tEnc := netlink.NewAttributeEncoder()
	tEnc.Bytes(unix.NLA_F_NESTED|ctaTupleIP, ipb)
	tb, err := tEnc.Encode()
	if err != nil {
		return nil, err
	}
	fEnc := netlink.NewAttributeEncoder()
	flags := make([]byte, 4)
	binary.NativeEndian.PutUint32(flags, uint32(flag))
	if tuple == ctaTupleOrig {
		fEnc.Bytes(ctaFilterOrg, flags)
	} else {
		fEnc.Bytes(ctaFilterRpl, flags)
	}
	fb, err := fEnc.Encode()
	if err != nil {
		return nil, err
	}
	enc := netlink.NewAttributeEncoder()
	enc.Bytes(unix.NLA_F_NESTED|tuple, tb)
	enc.Bytes(unix.NLA_F_NESTED|ctaFilter, fb)
	body, err := enc.Encode()
	if err != nil {
		return nil, err
	}
	msgs, err := conn.Execute(netlink.Message{
		Header: ctHeader(ipctnlMsgCtGet, netlink.Request|netlink.Dump),
		Data:   append(append([]byte{}, nfgen...), body...),
	})
	if err != nil {
		var oe *netlink.OpError
		if errors.As(err, &oe) && (errors.Is(oe.Err, unix.EOPNOTSUPP) || errors.Is(oe.Err, unix.EINVAL)) {
			return nil, errNoKernelFilter
		}
		return nil, err
	}
	var flows []ctFlow
	for _, m := range msgs {
		if m.Header.Flags&netlink.DumpInterrupted != 0 {
			return nil, errDumpInterrupted
		}
		if m.Header.Type != netlink.HeaderType(nfnlSubsysCTNetlink<<8|ipctnlMsgCtNew) || len(m.Data) < 4 {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			return nil, err
		}
		var f ctFlow
		for ad.Next() {
			switch ad.Type() {
			case ctaTupleOrig:
				f.tuple = ad.Bytes()
			case ctaID:
				f.id = ad.Bytes()
			case ctaZone:
				f.zone = ad.Bytes()
			}
		}
		if err := ad.Err(); err != nil {
			return nil, err
		}
		if f.tuple != nil {
			flows = append(flows, f)
		}
	}
	return flows, nil
}

func deleteFlow(conn *netlink.Conn, f ctFlow) error {
	enc := netlink.NewAttributeEncoder()
	enc.Bytes(unix.NLA_F_NESTED|ctaTupleOrig, f.tuple)
	if f.id != nil {
		enc.Bytes(ctaID, f.id)
	}
	if f.zone != nil {
		enc.Bytes(ctaZone, f.zone)
	}
	body, err := enc.Encode()
	if err != nil {
		return err
	}
	_, err = conn.Execute(netlink.Message{
		Header: ctHeader(ipctnlMsgCtDelete, netlink.Request|netlink.Acknowledge),
		Data:   append(append([]byte{}, nfgen...), body...),
	})
	return err
}
