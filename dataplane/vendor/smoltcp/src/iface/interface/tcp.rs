use super::*;

use crate::iface::SocketHandle;
use crate::socket::tcp::Socket;

impl InterfaceInner {
    pub(crate) fn process_tcp<'frame>(
        &mut self,
        sockets: &mut SocketSet,
        handled_by_raw_socket: bool,
        ip_repr: IpRepr,
        ip_payload: &'frame [u8],
    ) -> Option<Packet<'frame>> {
        let (src_addr, dst_addr) = (ip_repr.src_addr(), ip_repr.dst_addr());

        // Per RFC 1122 §3.2.1.3, the unspecified address must never appear as a source
        // or destination in any IP datagram. Drop such TCP segments early to avoid
        // creating sockets with unspecified peers (which would later panic on egress).
        // This is not done at the iface level because it might be useful with
        // UDP or raw sockets, but it's definitely not useful for TCP.
        if src_addr.is_unspecified() || dst_addr.is_unspecified() {
            return None;
        }

        let tcp_packet = check!(TcpPacket::new_checked(ip_payload));
        let tcp_repr = check!(TcpRepr::parse(
            &tcp_packet,
            &src_addr,
            &dst_addr,
            &self.caps.checksum
        ));

        // rdsd patch (vendor/smoltcp/PATCHES.md, item 6): a segment that carries an ACK goes
        // first to the socket that took the last such segment of its port pair (a small table
        // by ports). Only a socket with the segment's 4-tuple accepts it (a listener takes no
        // ACK), so the walk below would find that socket too, unless two sockets hold the same
        // 4-tuple (then the walk's lowest slot is no better a choice). With a socket per path
        // and two listeners per path, the walk passed every listener first.
        let hint = Self::tcp_hint(&tcp_repr);
        if tcp_repr.ack_number.is_some() {
            let slot = self.tcp_hints[hint];
            if let Some(item) = sockets.item_mut(slot) {
                self.tcp_ingress_examined += 1;
                if let Some(tcp_socket) = Socket::downcast_mut(&mut item.socket) {
                    if tcp_socket.accepts(self, &ip_repr, &tcp_repr) {
                        let (reply, left) = self.tcp_feed(item, &ip_repr, &tcp_repr);
                        sockets.egress_record(slot, Some(left));
                        return reply;
                    }
                }
            }
        }

        let mut taken = None;
        for item in sockets.items_mut() {
            self.tcp_ingress_examined += 1;
            let Some(tcp_socket) = Socket::downcast_mut(&mut item.socket) else {
                continue;
            };
            if tcp_socket.accepts(self, &ip_repr, &tcp_repr) {
                if tcp_repr.ack_number.is_some() {
                    self.tcp_hints[hint] = item.meta.handle.slot();
                }
                taken = Some(self.tcp_feed(item, &ip_repr, &tcp_repr));
                break;
            }
        }
        if let Some((reply, left)) = taken {
            sockets.egress_record(left.0.slot(), Some(left));
            return reply;
        }

        if tcp_repr.control == TcpControl::Rst
            || ip_repr.dst_addr().is_unspecified()
            || ip_repr.src_addr().is_unspecified()
            || handled_by_raw_socket
        {
            // Never reply to a TCP RST packet with another TCP RST packet.
            // Never send a TCP RST packet with unspecified addresses.
            // Never send a TCP RST when packet has been handled by raw socket.
            None
        } else {
            // The packet wasn't handled by a socket, send a TCP RST packet.
            let (ip, tcp) = tcp::Socket::rst_reply(&ip_repr, &tcp_repr);
            Some(Packet::new(ip, IpPayload::Tcp(tcp)))
        }
    }

    /// rdsd patch (PATCHES.md, item 6): the entry of `tcp_hints` for a segment's ports.
    fn tcp_hint(repr: &TcpRepr) -> usize {
        usize::from(repr.src_port ^ repr.dst_port.rotate_left(5)) % TCP_HINTS
    }

    /// A segment to the TCP socket that accepts it; the reply, and when the socket's egress is
    /// next due, for the caller to record in the socket set (`SocketSet::egress_record`).
    #[inline]
    fn tcp_feed(
        &mut self,
        item: &mut Item<'_>,
        ip_repr: &IpRepr,
        tcp_repr: &TcpRepr,
    ) -> (Option<Packet<'static>>, (SocketHandle, Instant)) {
        let Item { meta, socket } = item;
        let tcp_socket = Socket::downcast_mut(socket).expect("a TCP socket");
        // rdsd patch (vendor/smoltcp/PATCHES.md, items 4 and 8): its next egress looks at it
        // when its `poll_at` after the segment says so, as after a dispatch (`poll_at` mirrors
        // the start of `dispatch`), recorded at once: a segment that leaves nothing to send
        // (a pure ACK in, an ACK of ours delayed) costs no dispatch, and no egress either.
        self.touched.insert(meta.handle);
        self.fed_since.insert(meta.handle);
        let reply = tcp_socket
            .process(self, ip_repr, tcp_repr)
            .map(|(ip, tcp)| Packet::new(ip, IpPayload::Tcp(tcp)));
        let socket_poll_at = tcp_socket.poll_at(self);
        let at = meta.poll_at(socket_poll_at, |a| self.has_neighbor(&a), self.now);
        meta.egress_at = crate::iface::socket_meta::egress_time(at);
        (reply, (meta.handle, meta.egress_at))
    }
}
