//! What socket a blocked call waits on, for `wall`'s state frame: the peer
//! of a connected IP socket (`(socket 10.0.0.7:5432)`: which database or
//! service a request waits for), the port a listening socket listens on or
//! a connection was accepted on, or a Unix socket (by the path it listens
//! on, was accepted on or is bound to, else the path of the socket it is
//! connected to). BPF fills the header's peer fields for the waits it
//! walks; for a stack read in userspace they come from /proc/PID/net and
//! sock_diag (`diag`), by the socket's inode. What only the namespace's
//! tables tell (which ports and paths are listened on, a path's text) is
//! looked up as records are named (`Namespaces`); so is the path of a file
//! or device a call waits on (`files`).

mod diag;
mod files;

pub use files::set_identity as set_file_identity;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::unix::fs::MetadataExt;

use crate::bpf::types;
use crate::processes::ProcessId;

use types::rprof_unix_path as U;
use types::rprof_wall_object as O;

/// `AF_*` as the kernel numbers them.
const AF_UNIX: u16 = 1;
const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
/// `TCP_LISTEN` in /proc/net/tcp's `st` column.
const TCP_LISTEN: u32 = 0x0a;

/// What the network namespace's tables say of a wait's socket.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Known {
    #[default]
    Nothing,
    /// An IP connection accepted on the port it has (`local_port`): its peer
    /// is a client's passing port, a new one for each connection.
    AcceptedOnPort,
    /// A Unix socket listening on this path.
    UnixListening(String),
    /// A Unix connection accepted on this path.
    UnixAccepted(String),
    /// A Unix socket bound to this path, which is not listened on.
    UnixBound(String),
    /// A Unix socket connected to one with this path.
    UnixConnected(String),
    /// A file or device at this path.
    File(String),
    /// A pipe whose other end this process holds ("NAME [PID]").
    PipeWith(String),
}

/// What a wait's object is called in its state frame (` (socket ...)`,
/// ` (pipe)`...), from the header's object kind and peer, and what its
/// namespace's tables say of it.
pub fn label(h: &types::rprof_sample_header, known: &Known) -> String {
    match O(h.wall_object) {
        O::RPROF_WALL_OBJECT_SOCKET => match (known, peer_of(h)) {
            (Known::AcceptedOnPort, _) => format!(" (socket accepted on port {})", h.local_port),
            (Known::UnixListening(path), _) => format!(" (unix socket listening on {path})"),
            (Known::UnixAccepted(path), _) => format!(" (unix socket accepted on {path})"),
            (Known::UnixBound(path), _) => format!(" (unix socket bound to {path})"),
            (Known::UnixConnected(path), _) => format!(" (unix socket connected to {path})"),
            (_, Some(addr)) => format!(" (socket {addr})"),
            _ if h.peer_family == AF_UNIX => " (unix socket)".to_string(),
            _ => " (socket)".to_string(),
        },
        O::RPROF_WALL_OBJECT_LISTENING => format!(" (socket listening on port {})", h.peer_port),
        O::RPROF_WALL_OBJECT_PIPE => match known {
            Known::PipeWith(process) => format!(" (pipe with {process})"),
            _ => " (pipe)".to_string(),
        },
        O::RPROF_WALL_OBJECT_FILE | O::RPROF_WALL_OBJECT_DEVICE => {
            let kind = if O(h.wall_object) == O::RPROF_WALL_OBJECT_FILE {
                "file"
            } else {
                "device"
            };
            match known {
                Known::File(path) => format!(" ({kind} {path})"),
                _ => format!(" ({kind})"),
            }
        }
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
/// it is TCP), and Unix ones (their path, or nothing, and whether they
/// listen), with the peer of each connected one.
#[derive(Default)]
struct Table {
    ip: HashMap<u64, (Row, u16, bool)>,
    unix: HashMap<u64, (String, bool)>,
    /// Read when first needed (a client's end, which has no path).
    unix_peers: Option<HashMap<u64, u64>>,
}

impl Sockets {
    /// The socket with inode `inode` of process `pid` into `h`'s peer
    /// fields; returns its object kind (a listening socket's differs).
    pub fn describe(&mut self, pid: u32, inode: u64, h: &mut types::rprof_sample_header) -> u32 {
        let table = self.0.entry(pid).or_insert_with(|| Table::read(pid));
        if let Some((row, family, tcp)) = table.ip.get(&inode) {
            h.peer_family = *family;
            if *tcp && row.state == TCP_LISTEN {
                h.peer_port = row.local_port;
                return O::RPROF_WALL_OBJECT_LISTENING.0;
            }
            h.peer_port = row.remote_port;
            // TCP's only, as BPF's (`socket_peer`).
            if *tcp {
                h.local_port = row.local_port;
            }
            h.peer_addr = row.remote;
        } else if let Some((path, listening)) = table.unix.get(&inode) {
            // As BPF's `unix_path`: its own path, else its peer's.
            h.peer_family = AF_UNIX;
            let (whose, path) = match (path.is_empty(), *listening) {
                (false, true) => (U::RPROF_UNIX_PATH_LISTENING, path),
                (false, false) => (U::RPROF_UNIX_PATH_OWN, path),
                // Without sock_diag (no CAP_SYS_ADMIN for another
                // namespace), a client's end is only `(unix socket)`.
                (true, _) => match table
                    .unix_peers
                    .get_or_insert_with(|| diag::unix_peers(pid).unwrap_or_default())
                    .get(&inode)
                    .and_then(|p| table.unix.get(p))
                {
                    Some((path, _)) if !path.is_empty() => (U::RPROF_UNIX_PATH_PEER, path),
                    _ => return O::RPROF_WALL_OBJECT_SOCKET.0,
                },
            };
            h.peer_port = whose.0 as u16;
            h.peer_addr[..8].copy_from_slice(&path_hash(path).to_ne_bytes());
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
            for row in ip_rows(pid, name) {
                table.ip.insert(row.inode, (row, family, name.starts_with("tcp")));
            }
        }
        table.unix = unix_rows(pid).into_iter().collect();
        table
    }
}

/// What the sockets and files of records are called, found as records are
/// named: their namespaces' tables (`Namespaces`), the files' paths
/// (`files::Files`).
#[derive(Default)]
pub struct Names {
    namespaces: Namespaces,
    files: files::Files,
}

impl Names {
    /// What the socket or file a wait of process `id`, `h`, is on is called.
    pub fn look_up(&mut self, id: ProcessId, h: &types::rprof_sample_header, epoch: u64) -> Known {
        match O(h.wall_object) {
            O::RPROF_WALL_OBJECT_SOCKET => self.namespaces.look_up(id, h, epoch),
            O::RPROF_WALL_OBJECT_FILE | O::RPROF_WALL_OBJECT_DEVICE => self.files.look_up(id, h),
            O::RPROF_WALL_OBJECT_PIPE => self.files.pipe(id, h),
            _ => Known::Nothing,
        }
    }

    /// Forgets a process that ended.
    pub fn forget(&mut self, id: &ProcessId) {
        self.namespaces.forget(id);
        self.files.forget(id);
    }
}

/// What each network namespace of the followed processes listens on: a
/// connected socket whose own port (TCP) or path (Unix) is listened on was
/// accepted there. Read from /proc/PID/net/{tcp,tcp6,unix} when a socket is
/// not known either way, at most once an epoch per namespace (a host's
/// processes share one: a busy host's tables take milliseconds to read, in
/// the recording loop); a TCP port found not listened on is trusted for
/// `KEEP_EPOCHS` (a port in use by a connection cannot be listened on).
#[derive(Default)]
struct Namespaces {
    tables: HashMap<u64, Listeners>,
    /// Each process's namespace (the inode of /proc/PID/ns/net).
    namespace: HashMap<ProcessId, u64>,
}

#[derive(Default)]
struct Listeners {
    ports: HashSet<u16>,
    not: HashSet<u16>,
    /// Unix sockets' paths by their hash (`path_hash`): all a record
    /// carries, so that a connection accepted after the tables were read
    /// is named by its listener's path, read before.
    unix: HashMap<u64, String>,
    /// The hashes of the paths Unix sockets listen on.
    unix_listened: HashSet<u64>,
    /// Hashes not found when the tables were read for them.
    unix_not: HashSet<u64>,
    /// The epoch the tables were last read in.
    read_in: Option<u64>,
}

/// Epochs (of half a second) a port found not listened on is trusted.
const KEEP_EPOCHS: u64 = 120;

/// `__SO_ACCEPTCON` in /proc/net/unix's flags: the socket listens.
const SO_ACCEPTCON: u32 = 0x10000;

impl Namespaces {
    /// What process `id`'s namespace says of the socket a wait of `h` is on.
    fn look_up(&mut self, id: ProcessId, h: &types::rprof_sample_header, epoch: u64) -> Known {
        let tcp = matches!(h.peer_family, AF_INET | AF_INET6) && h.local_port != 0;
        let unix = h.peer_family == AF_UNIX && h.peer_port != U::RPROF_UNIX_PATH_NONE.0 as u16;
        if !tcp && !unix {
            return Known::Nothing;
        }
        let Some(t) = self.tables_of(id, epoch) else {
            return Known::Nothing;
        };
        if tcp {
            return t.tcp(h.local_port, id.pid, epoch);
        }
        let hash = u64::from_ne_bytes(h.peer_addr[..8].try_into().unwrap_or_default());
        t.unix(hash, U(u32::from(h.peer_port)), id.pid, epoch)
    }

    fn tables_of(&mut self, id: ProcessId, epoch: u64) -> Option<&mut Listeners> {
        let namespace = match self.namespace.get(&id) {
            Some(ns) => *ns,
            None => {
                let ns = std::fs::metadata(format!("/proc/{}/ns/net", id.pid)).ok()?.ino();
                self.namespace.insert(id, ns);
                ns
            }
        };
        let t = self.tables.entry(namespace).or_default();
        if t.read_in.is_none_or(|at| epoch >= at + KEEP_EPOCHS) {
            t.not.clear();
            t.unix_not.clear();
        }
        Some(t)
    }

    /// Forgets a process that ended, and its namespace if it was the last
    /// followed in it.
    fn forget(&mut self, id: &ProcessId) {
        if let Some(ns) = self.namespace.remove(id) {
            if !self.namespace.values().any(|n| *n == ns) {
                self.tables.remove(&ns);
            }
        }
    }
}

impl Listeners {
    fn tcp(&mut self, port: u16, pid: u32, epoch: u64) -> Known {
        if !self.ports.contains(&port) && !self.not.contains(&port) {
            self.read(pid, epoch);
            if !self.ports.contains(&port) {
                self.not.insert(port);
            }
        }
        if self.ports.contains(&port) {
            Known::AcceptedOnPort
        } else {
            Known::Nothing
        }
    }

    /// The path `hash` names, `whose` (`unix_path` in BPF). A path not seen
    /// yet has the tables read for it, once: the paths are few (one per
    /// listener), unlike the connections.
    fn unix(&mut self, hash: u64, whose: U, pid: u32, epoch: u64) -> Known {
        if !self.unix.contains_key(&hash) && !self.unix_not.contains(&hash) {
            self.read_now(pid, epoch);
            if !self.unix.contains_key(&hash) {
                self.unix_not.insert(hash);
            }
        }
        let Some(path) = self.unix.get(&hash).cloned() else {
            return Known::Nothing;
        };
        match whose {
            U::RPROF_UNIX_PATH_LISTENING => Known::UnixListening(path),
            U::RPROF_UNIX_PATH_OWN if self.unix_listened.contains(&hash) => Known::UnixAccepted(path),
            U::RPROF_UNIX_PATH_OWN => Known::UnixBound(path),
            U::RPROF_UNIX_PATH_PEER => Known::UnixConnected(path),
            _ => Known::Nothing,
        }
    }

    /// Reads the tables again unless they were read this epoch.
    fn read(&mut self, pid: u32, epoch: u64) {
        if self.read_in != Some(epoch) {
            self.read_now(pid, epoch);
        }
    }

    fn read_now(&mut self, pid: u32, epoch: u64) {
        self.read_in = Some(epoch);
        self.ports = ["tcp", "tcp6"]
            .into_iter()
            .flat_map(|name| ip_rows(pid, name))
            .filter(|row| row.state == TCP_LISTEN)
            .map(|row| row.local_port)
            .collect();
        // Anew, not added to: a host's abstract sockets come and go.
        self.unix.clear();
        self.unix_listened.clear();
        for (_, (path, listening)) in unix_rows(pid) {
            if path.is_empty() {
                continue;
            }
            let hash = path_hash(&path);
            if listening {
                self.unix_listened.insert(hash);
            }
            self.unix.insert(hash, path);
        }
    }
}

/// The FNV-1a hash of a Unix socket's path as /proc/net/unix shows it, as
/// BPF's `unix_path_hash` makes it.
fn path_hash(path: &str) -> u64 {
    path.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The rows of /proc/PID/net/NAME (tcp, tcp6, udp, udp6); none if it
/// cannot be read.
fn ip_rows(pid: u32, name: &str) -> Vec<Row> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/{name}")).unwrap_or_default();
    text.lines().skip(1).filter_map(Row::parse).collect()
}

/// The rows of /proc/PID/net/unix (`unix_row`); none if it cannot be read.
fn unix_rows(pid: u32) -> Vec<(u64, (String, bool))> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/unix")).unwrap_or_default();
    text.lines().skip(1).filter_map(unix_row).collect()
}

/// A row of /proc/net/unix, "Num RefCount Protocol Flags Type St Inode
/// Path" (hexadecimal flags, the path only for a bound socket): its inode,
/// path (or nothing), and whether it listens. The kernel prints the path
/// after one space, byte for byte: spaces in it are its own, and kept, for
/// its hash to be BPF's.
fn unix_row(line: &str) -> Option<(u64, (String, bool))> {
    let mut fields = [""; 7];
    let mut rest = line;
    for field in &mut fields {
        rest = rest.trim_start_matches(' ');
        (*field, rest) = rest.split_at(rest.find(' ').unwrap_or(rest.len()));
    }
    let flags = u32::from_str_radix(fields[3], 16).ok()?;
    let inode = fields[6].parse().ok()?;
    let path = rest.strip_prefix(' ').unwrap_or_default();
    Some((inode, (path.to_string(), flags & SO_ACCEPTCON != 0)))
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
        assert_eq!(label(&h, &Known::Nothing), " (socket 127.0.0.1:5432)");
        let v6 = "   0: 00000000000000000000000001000000:1F90 00000000000000000000000001000000:D431 01 00000000:00000000 00:00000000 00000000  1000        0 1234 1";
        let r = Row::parse(v6).expect("a tcp6 row");
        (h.peer_family, h.peer_port, h.peer_addr) = (AF_INET6, r.remote_port, r.remote);
        assert_eq!(label(&h, &Known::Nothing), " (socket [::1]:54321)");
        h.local_port = 8080;
        assert_eq!(
            label(&h, &Known::AcceptedOnPort),
            " (socket accepted on port 8080)"
        );
        h.wall_object = O::RPROF_WALL_OBJECT_LISTENING.0;
        h.peer_port = 8080;
        assert_eq!(label(&h, &Known::Nothing), " (socket listening on port 8080)");
    }

    /// A path with spaces in a row, and one at its end, is read back from
    /// the kernel's own table as it was bound.
    #[test]
    fn a_unix_path_is_read_with_its_spaces() {
        let dir = std::env::temp_dir().join(format!("rprof-unix-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("two  spaces, and one ");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
        let inode = std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap().ino();
        let rows: HashMap<u64, (String, bool)> = unix_rows(std::process::id()).into_iter().collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            rows.get(&inode),
            Some(&(path.to_str().unwrap().to_string(), true))
        );
    }

    #[test]
    fn proc_net_unix_rows() {
        let listening = "00000000d16649f8: 00000002 00000000 00010000 0001 01 4390595 /run/puma.sock";
        let accepted = "00000000e667ca6c: 00000003 00000000 00000000 0001 03 4390597 /run/puma.sock";
        let client = "0000000047c4a1b3: 00000003 00000000 00000000 0001 03 4390596";
        let path = "/run/puma.sock".to_string();
        assert_eq!(unix_row(listening), Some((4390595, (path.clone(), true))));
        assert_eq!(unix_row(accepted), Some((4390597, (path.clone(), false))));
        assert_eq!(unix_row(client), Some((4390596, (String::new(), false))));
        // (the inode is printed in five columns at least)
        let padded = "0000000047c4a1b3: 00000002 00000000 00010000 0001 01   871 @a  b ";
        assert_eq!(unix_row(padded), Some((871, ("@a  b ".to_string(), true))));
        let mut h = types::rprof_sample_header {
            wall_object: O::RPROF_WALL_OBJECT_SOCKET.0,
            peer_family: AF_UNIX,
            ..Default::default()
        };
        assert_eq!(label(&h, &Known::Nothing), " (unix socket)");
        assert_eq!(
            label(&h, &Known::UnixAccepted(path.clone())),
            " (unix socket accepted on /run/puma.sock)"
        );
        assert_eq!(
            label(&h, &Known::UnixConnected(path.clone())),
            " (unix socket connected to /run/puma.sock)"
        );
        h.wall_object = O::RPROF_WALL_OBJECT_PIPE.0;
        assert_eq!(label(&h, &Known::UnixListening(path)), " (pipe)");
    }

    /// FNV-1a, 64 bits, as BPF's `unix_path_hash` (the function's published
    /// test values).
    #[test]
    fn path_hashes() {
        assert_eq!(path_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(path_hash("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(path_hash("foobar"), 0x8594_4171_f739_67e8);
    }
}
