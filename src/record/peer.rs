//! What socket a blocked call waits on, for `wall`'s state frame: the peer
//! of a connected IP socket (`(socket 10.0.0.7:5432)`: which database or
//! service a request waits for), the port a listening socket listens on, or
//! a Unix socket. BPF fills the header's peer fields for the waits it
//! walks; for a stack read in userspace they come from /proc/PID/net, by the
//! socket's inode.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::unix::fs::MetadataExt;

use crate::bpf::types;
use crate::processes::ProcessId;

use types::rprof_wall_object as O;

/// `AF_*` as the kernel numbers them.
const AF_UNIX: u16 = 1;
const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
/// `TCP_LISTEN` in /proc/net/tcp's `st` column.
const TCP_LISTEN: u32 = 0x0a;

/// What a wait's object is called in its state frame (` (socket ...)`,
/// ` (pipe)`...), from the header's object kind and peer; a connection
/// `accepted` on a port its namespace listens on is called by that port
/// (its peer is a client's passing port, a new one for each connection).
pub fn label(h: &types::rprof_sample_header, accepted: bool) -> String {
    match O(h.wall_object) {
        O::RPROF_WALL_OBJECT_SOCKET if accepted => {
            format!(" (socket accepted on port {})", h.local_port)
        }
        O::RPROF_WALL_OBJECT_SOCKET => match peer_of(h) {
            Some(addr) => format!(" (socket {addr})"),
            None if h.peer_family == AF_UNIX => " (unix socket)".to_string(),
            None => " (socket)".to_string(),
        },
        O::RPROF_WALL_OBJECT_LISTENING => format!(" (socket listening on port {})", h.peer_port),
        O::RPROF_WALL_OBJECT_PIPE => " (pipe)".to_string(),
        O::RPROF_WALL_OBJECT_FILE => " (file)".to_string(),
        O::RPROF_WALL_OBJECT_DEVICE => " (device)".to_string(),
        _ => String::new(),
    }
}

/// The peer's address, for an IP socket connected to one.
fn peer_of(h: &types::rprof_sample_header) -> Option<SocketAddr> {
    if h.peer_port == 0 {
        return None;
    }
    let ip = match h.peer_family {
        AF_INET => IpAddr::V4(Ipv4Addr::new(
            h.peer_addr[0],
            h.peer_addr[1],
            h.peer_addr[2],
            h.peer_addr[3],
        )),
        AF_INET6 => {
            let v6 = Ipv6Addr::from(h.peer_addr);
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, h.peer_port))
}

/// For waits whose stack userspace read: each process's sockets, from
/// /proc/PID/net, read once a sweep (a thousand threads blocked on sockets
/// would otherwise read the tables a thousand times).
#[derive(Default)]
pub struct Sockets(HashMap<u32, Table>);

/// One process's sockets by inode: IP ones (their row, family, and whether
/// a TCP one listens), and Unix ones.
#[derive(Default)]
struct Table {
    ip: HashMap<u64, (Row, u16, bool)>,
    unix: HashSet<u64>,
}

impl Sockets {
    /// The socket with inode `inode` of process `pid` into `h`'s peer
    /// fields; returns its object kind (a listening socket's differs).
    pub fn describe(&mut self, pid: u32, inode: u64, h: &mut types::rprof_sample_header) -> u32 {
        let table = self.0.entry(pid).or_insert_with(|| Table::read(pid));
        if let Some((row, family, listening)) = table.ip.get(&inode) {
            h.peer_family = *family;
            if *listening {
                h.peer_port = row.local_port;
                return O::RPROF_WALL_OBJECT_LISTENING.0;
            }
            h.peer_port = row.remote_port;
            h.local_port = row.local_port;
            h.peer_addr = row.remote;
        } else if table.unix.contains(&inode) {
            h.peer_family = AF_UNIX;
        }
        O::RPROF_WALL_OBJECT_SOCKET.0
    }
}

impl Table {
    fn read(pid: u32) -> Table {
        let mut table = Table::default();
        for (name, family) in [
            ("tcp", AF_INET),
            ("tcp6", AF_INET6),
            ("udp", AF_INET),
            ("udp6", AF_INET6),
        ] {
            let text = std::fs::read_to_string(format!("/proc/{pid}/net/{name}")).unwrap_or_default();
            for row in text.lines().skip(1).filter_map(Row::parse) {
                let listening = row.state == TCP_LISTEN && name.starts_with("tcp");
                table.ip.insert(row.inode, (row, family, listening));
            }
        }
        let unix = std::fs::read_to_string(format!("/proc/{pid}/net/unix")).unwrap_or_default();
        // "Num RefCount Protocol Flags Type St Inode Path": the inode is the 7th.
        table.unix = unix
            .lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().nth(6)?.parse().ok())
            .collect();
        table
    }
}

/// The TCP ports listened on in each network namespace of the followed
/// processes: a connected socket whose own port is one of them was accepted
/// there. Read from /proc/PID/net/tcp{,6} when a socket's port is not known
/// either way, at most once an epoch per namespace (a host's processes share
/// one: a read of a busy host's tables takes milliseconds); what is not
/// listened on is trusted for `KEEP_EPOCHS` (a port in use by a connection
/// cannot be listened on).
#[derive(Default)]
pub struct Listening {
    ports: HashMap<u64, Ports>,
    /// Each process's namespace (the inode of /proc/PID/ns/net).
    namespace: HashMap<ProcessId, u64>,
}

#[derive(Default)]
struct Ports {
    listening: HashSet<u16>,
    not: HashSet<u16>,
    /// The epoch the ports were last read in.
    read_in: Option<u64>,
}

/// Epochs (of half a second) a port found not listened on is trusted.
const KEEP_EPOCHS: u64 = 120;

impl Listening {
    /// Whether the socket of `h` (a wait on a connected IP socket of
    /// process `id`) was accepted on a port its namespace listens on.
    pub fn accepted(&mut self, id: ProcessId, h: &types::rprof_sample_header, epoch: u64) -> bool {
        if O(h.wall_object) != O::RPROF_WALL_OBJECT_SOCKET
            || h.local_port == 0
            || !matches!(h.peer_family, AF_INET | AF_INET6)
        {
            return false;
        }
        let namespace = match self.namespace.get(&id) {
            Some(ns) => *ns,
            None => {
                let Ok(meta) = std::fs::metadata(format!("/proc/{}/ns/net", id.pid)) else {
                    return false;
                };
                self.namespace.insert(id, meta.ino());
                meta.ino()
            }
        };
        let port = h.local_port;
        let p = self.ports.entry(namespace).or_default();
        if p.read_in.is_none_or(|at| epoch >= at + KEEP_EPOCHS) {
            p.not.clear();
        }
        if p.listening.contains(&port) {
            return true;
        }
        if p.not.contains(&port) {
            return false;
        }
        if p.read_in != Some(epoch) {
            p.listening = listening_ports(id.pid);
            p.read_in = Some(epoch);
            if p.listening.contains(&port) {
                return true;
            }
        }
        p.not.insert(port);
        false
    }

    /// Forgets a process that ended, and its namespace if it was the last
    /// followed in it.
    pub fn forget(&mut self, id: &ProcessId) {
        if let Some(ns) = self.namespace.remove(id) {
            if !self.namespace.values().any(|n| *n == ns) {
                self.ports.remove(&ns);
            }
        }
    }
}

/// The TCP ports listened on in process `pid`'s network namespace.
fn listening_ports(pid: u32) -> HashSet<u16> {
    ["tcp", "tcp6"]
        .iter()
        .flat_map(|name| {
            let text = std::fs::read_to_string(format!("/proc/{pid}/net/{name}")).unwrap_or_default();
            text.lines()
                .skip(1)
                .filter_map(Row::parse)
                .filter(|row| row.state == TCP_LISTEN)
                .map(|row| row.local_port)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A row of /proc/net/{tcp,tcp6,udp,udp6}.
struct Row {
    local_port: u16,
    remote: [u8; 16],
    remote_port: u16,
    state: u32,
    inode: u64,
}

impl Row {
    /// "sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...", the
    /// addresses "HEX:PORT" with each 32-bit word of the address in the
    /// machine's byte order.
    fn parse(line: &str) -> Option<Row> {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (_, local_port) = endpoint(f.get(1)?)?;
        let (remote, remote_port) = endpoint(f.get(2)?)?;
        Some(Row {
            local_port,
            remote,
            remote_port,
            state: u32::from_str_radix(f.get(3)?, 16).ok()?,
            inode: f.get(9)?.parse().ok()?,
        })
    }
}

/// "0100007F:1F90" (or 32 hex digits for IPv6): the address's bytes in
/// network order, and the port.
fn endpoint(text: &str) -> Option<([u8; 16], u16)> {
    let (addr, port) = text.split_once(':')?;
    let mut bytes = [0u8; 16];
    for (i, word) in addr.as_bytes().chunks(8).enumerate().take(4) {
        let word = u32::from_str_radix(std::str::from_utf8(word).ok()?, 16).ok()?;
        bytes[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
    }
    Some((bytes, u16::from_str_radix(port, 16).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_net_rows() {
        let v4 = "   3: 0100007F:9C41 0100007F:1538 01 00000000:00000000 00:00000000 00000000  1000        0 48211 1 0000000000000000 20 4 30 10 -1";
        let r = Row::parse(v4).expect("a tcp row");
        assert_eq!(
            (r.local_port, r.remote_port, r.state, r.inode),
            (0x9c41, 5432, 1, 48211)
        );
        let mut h = types::rprof_sample_header {
            wall_object: O::RPROF_WALL_OBJECT_SOCKET.0,
            peer_family: AF_INET,
            peer_port: r.remote_port,
            peer_addr: r.remote,
            ..Default::default()
        };
        assert_eq!(label(&h, false), " (socket 127.0.0.1:5432)");
        let v6 = "   0: 00000000000000000000000001000000:1F90 00000000000000000000000001000000:D431 01 00000000:00000000 00:00000000 00000000  1000        0 1234 1";
        let r = Row::parse(v6).expect("a tcp6 row");
        (h.peer_family, h.peer_port, h.peer_addr) = (AF_INET6, r.remote_port, r.remote);
        assert_eq!(label(&h, false), " (socket [::1]:54321)");
        h.local_port = 8080;
        assert_eq!(label(&h, true), " (socket accepted on port 8080)");
        h.wall_object = O::RPROF_WALL_OBJECT_LISTENING.0;
        h.peer_port = 8080;
        assert_eq!(label(&h, false), " (socket listening on port 8080)");
    }
}
