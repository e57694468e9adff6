package network

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// The records of connections come from the kernel: the shared chains log a
// new connection they accept or refuse, through the owner's log chain (at
// most 20 a second per sandbox and decision), to this process's NFLOG
// group, with the prefix "cage <a|d>" and the packet's first bytes; the
// sandbox is the packet's source address on the interface it came in on
// (the rules have tied it to the sandbox's interface; the interface tells
// a slot's holders apart, see Host.sender). A group has one listener, so each cage process
// takes a free one.

// nfnetlink_log constants (linux/netfilter/nfnetlink_log.h).
const (
	nfnlSubsysULOG     = 4
	nfulnlMsgPacket    = 0
	nfulnlMsgConfig    = 1
	nfulaIfindexIndev  = 4
	nfulaPayload       = 9
	nfulaPrefix        = 10
	nfulaCfgCmd        = 1
	nfulaCfgMode       = 2
	nfulaCfgTimeout    = 4
	nfulaCfgQThresh    = 5
	nfulnlCfgCmdBind   = 1
	nfulnlCfgCmdUnbind = 2
	nfulnlCopyPacket   = 2
	logCopyRange       = 64 // IPv4 header and the ports
)

type nflog struct {
	conn  *netlink.Conn
	group uint16
	done  chan struct{}
}

// openLog binds a free NFLOG group and delivers what it logs to out.
func openLog(out func(decision string, inLink int, pkt []byte)) (*nflog, error) {
	conn, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return nil, fmt.Errorf("nflog: %w", err)
	}
	start := 0x6300 + uint16(os.Getpid()%0x1000)
	for i := range uint16(0x1000) {
		g := start + i
		if err := logConfig(conn, g, netlink.Attribute{Type: nfulaCfgCmd, Data: []byte{nfulnlCfgCmdBind}}); err != nil {
			if errors.Is(err, unix.EBUSY) || errors.Is(err, unix.EEXIST) || errors.Is(err, unix.EPERM) {
				continue
			}
			conn.Close()
			return nil, fmt.Errorf("nflog: bind group %d: %w", g, err)
		}
		mode := make([]byte, 6)
		binary.BigEndian.PutUint32(mode, logCopyRange)
		mode[4] = nfulnlCopyPacket
		timeout := binary.BigEndian.AppendUint32(nil, 1) // deliver within 10 ms
		qthresh := binary.BigEndian.AppendUint32(nil, 1)
		if err := logConfig(conn, g, netlink.Attribute{Type: nfulaCfgMode, Data: mode},
			netlink.Attribute{Type: nfulaCfgTimeout, Data: timeout}, netlink.Attribute{Type: nfulaCfgQThresh, Data: qthresh}); err != nil {
			conn.Close()
			return nil, fmt.Errorf("nflog: configure group %d: %w", g, err)
		}
		l := &nflog{conn: conn, group: g, done: make(chan struct{})}
		go l.read(out)
		return l, nil
	}
	conn.Close()
	return nil, errors.New("nflog: no free log group")
}

// groupFree reports whether no one has bound log group g (then this
// process could: it binds it and lets it go at once).
func groupFree(g uint16) bool {
	conn, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return false
	}
	defer conn.Close()
	if logConfig(conn, g, netlink.Attribute{Type: nfulaCfgCmd, Data: []byte{nfulnlCfgCmdBind}}) != nil {
		return false
	}
	_ = logConfig(conn, g, netlink.Attribute{Type: nfulaCfgCmd, Data: []byte{nfulnlCfgCmdUnbind}})
	return true
}

func logConfig(conn *netlink.Conn, group uint16, attrs ...netlink.Attribute) error {
	body, err := netlink.MarshalAttributes(attrs)
	if err != nil {
		return err
	}
	hdr := []byte{unix.AF_UNSPEC, 0 /* NFNETLINK_V0 */, 0, 0}
	binary.BigEndian.PutUint16(hdr[2:], group)
	_, err = conn.Execute(netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(nfnlSubsysULOG<<8 | nfulnlMsgConfig), Flags: netlink.Request | netlink.Acknowledge},
		Data:   append(hdr, body...),
	})
	return err
}

func (l *nflog) read(out func(decision string, inLink int, pkt []byte)) {
	defer close(l.done)
	for {
		msgs, err := l.conn.Receive()
		if err != nil {
			var oe *netlink.OpError
			if errors.As(err, &oe) && errors.Is(oe.Err, unix.ENOBUFS) {
				continue // records were lost to a burst; go on
			}
			return // closed
		}
		for _, m := range msgs {
			if m.Header.Type != netlink.HeaderType(nfnlSubsysULOG<<8|nfulnlMsgPacket) || len(m.Data) < 4 {
				continue
			}
			ad, err := netlink.NewAttributeDecoder(m.Data[4:])
			if err != nil {
				continue
			}
			var prefix string
			var payload []byte
			var inLink int
			for ad.Next() {
				switch ad.Type() {
				case nfulaIfindexIndev:
					if b := ad.Bytes(); len(b) == 4 {
						inLink = int(binary.BigEndian.Uint32(b))
					}
				case nfulaPrefix:
					prefix = strings.TrimRight(string(ad.Bytes()), "\x00")
				case nfulaPayload:
					payload = ad.Bytes()
				}
			}
			f := strings.Fields(prefix)
			if len(f) != 2 || f[0] != "cage" {
				continue
			}
			out(f[1], inLink, payload)
		}
	}
}

func (l *nflog) close() {
	l.conn.Close()
	select {
	case <-l.done:
	case <-time.After(time.Second):
	}
}

// packetDest is the destination of an IPv4 packet: protocol, address and
// port (0 for a protocol without ports).
func packetDest(pkt []byte) (string, netip.AddrPort, bool) {
	if len(pkt) < 20 || pkt[0]>>4 != 4 {
		return "", netip.AddrPort{}, false
	}
	hl := int(pkt[0]&0x0f) * 4
	dst := netip.AddrFrom4([4]byte(pkt[16:20]))
	var port uint16
	proto := strconv.Itoa(int(pkt[9]))
	switch pkt[9] {
	case unix.IPPROTO_TCP, unix.IPPROTO_UDP:
		proto = map[byte]string{unix.IPPROTO_TCP: "tcp", unix.IPPROTO_UDP: "udp"}[pkt[9]]
		if len(pkt) >= hl+4 {
			port = binary.BigEndian.Uint16(pkt[hl+2:])
		}
	case unix.IPPROTO_ICMP:
		proto = "icmp"
	}
	return proto, netip.AddrPortFrom(dst, port), true
}
