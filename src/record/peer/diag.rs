//! The peers of a network namespace's Unix sockets, from the kernel's
//! sock_diag netlink interface: /proc/net/unix names each socket's own path
//! but not what it is connected to, which is all a client's end has to tell.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use anyhow::{bail, Context, Result};
use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_sock_diag::unix::{nlas::Nla, ShowFlags, StateFlags, UnixRequest};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket, SocketAddr};

/// Each connected Unix socket's peer, by inode, in process `pid`'s network
/// namespace (entered from a thread of its own when it is not rprof's).
pub fn unix_peers(pid: u32) -> Result<HashMap<u64, u64>> {
    let theirs = File::open(format!("/proc/{pid}/ns/net")).context("open its network namespace")?;
    let ours = std::fs::metadata("/proc/self/ns/net").context("read rprof's network namespace")?;
    if theirs.metadata()?.ino() == ours.ino() {
        return dump();
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns changes only this thread's namespace, and the
            // thread ends with the dump.
            if unsafe { libc::setns(theirs.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                bail!("enter its network namespace: {}", std::io::Error::last_os_error());
            }
            dump()
        })
        .join()
        .unwrap_or_else(|_| bail!("the namespace's reader failed"))
    })
}

/// One dump of the namespace the calling thread is in.
fn dump() -> Result<HashMap<u64, u64>> {
    let mut socket = Socket::new(NETLINK_SOCK_DIAG).context("open a sock_diag socket")?;
    socket.bind_auto().context("bind a sock_diag socket")?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .context("connect a sock_diag socket")?;
    // Never a hang in the recording loop: a dump that stops is an error.
    let timeout = libc::timeval {
        tv_sec: 1,
        tv_usec: 0,
    };
    // SAFETY: the option's value is a timeval of the size given.
    let set = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if set != 0 {
        bail!("time-limit sock_diag: {}", std::io::Error::last_os_error());
    }
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let request = SockDiagMessage::UnixRequest(UnixRequest {
        state_flags: StateFlags::all(),
        inode: 0,
        show_flags: ShowFlags::PEER,
        cookie: [0xff; 8],
    });
    let mut packet = NetlinkMessage::new(header, request.into());
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    socket.send(&buf, 0).context("send the sock_diag request")?;
    let mut peers = HashMap::new();
    loop {
        let (datagram, _) = socket.recv_from_full().context("read sock_diag")?;
        let mut at = 0;
        while at < datagram.len() {
            let message =
                NetlinkMessage::<SockDiagMessage>::deserialize(&datagram[at..]).context("parse sock_diag")?;
            match message.payload {
                NetlinkPayload::InnerMessage(SockDiagMessage::UnixResponse(r)) => {
                    for nla in &r.nlas {
                        if let Nla::Peer(peer) = nla {
                            peers.insert(u64::from(r.header.inode), u64::from(*peer));
                        }
                    }
                }
                NetlinkPayload::Done(_) => return Ok(peers),
                NetlinkPayload::Error(e) => bail!("sock_diag: {e}"),
                _ => {}
            }
            let len = message.header.length as usize;
            if len == 0 {
                break;
            }
            at += len;
        }
    }
}
