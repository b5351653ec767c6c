//! A Pyroscope push receiver for the agent's tests, written from the
//! protocol's facts (../shared/notes/fleet-backends.md): Connect's unary
//! `POST /push.v1.PusherService/Push`, a gzipped binary `PushRequest` whose
//! samples are gzipped pprof profiles, checked as Pyroscope checks them
//! (label names, `__name__` and `service_name`, 16,000 samples, the
//! ingestion window); answers scripted on demand, or no answer at all;
//! over TLS if asked (rustls, with a certificate the test makes).

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use prost::Message;

// The messages are defined here again, from the field numbers in the notes,
// not shared with rprof's: a wrong number on either side must fail.

#[derive(Clone, PartialEq, Message)]
struct PushRequest {
    #[prost(message, repeated, tag = "1")]
    series: Vec<Series>,
}

#[derive(Clone, PartialEq, Message)]
struct Series {
    #[prost(message, repeated, tag = "1")]
    labels: Vec<LabelPair>,
    #[prost(message, repeated, tag = "2")]
    samples: Vec<RawSample>,
}

#[derive(Clone, PartialEq, Message)]
struct LabelPair {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    value: String,
}

#[derive(Clone, PartialEq, Message)]
struct RawSample {
    #[prost(bytes = "vec", tag = "1")]
    raw_profile: Vec<u8>,
    #[prost(string, tag = "2")]
    id: String,
}

/// The parts of pprof's `Profile` the tests read.
#[derive(Clone, PartialEq, Message)]
struct PprofProfile {
    #[prost(message, repeated, tag = "2")]
    sample: Vec<PprofSample>,
    #[prost(message, repeated, tag = "4")]
    location: Vec<PprofLocation>,
    #[prost(message, repeated, tag = "5")]
    function: Vec<PprofFunction>,
    #[prost(string, repeated, tag = "6")]
    string_table: Vec<String>,
    #[prost(int64, tag = "9")]
    time_nanos: i64,
    #[prost(int64, tag = "10")]
    duration_nanos: i64,
}

#[derive(Clone, PartialEq, Message)]
struct PprofSample {
    #[prost(uint64, repeated, tag = "1")]
    location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    value: Vec<i64>,
}

#[derive(Clone, PartialEq, Message)]
struct PprofLocation {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(message, repeated, tag = "4")]
    line: Vec<PprofLine>,
}

#[derive(Clone, PartialEq, Message)]
struct PprofLine {
    #[prost(uint64, tag = "1")]
    function_id: u64,
    #[prost(int64, tag = "2")]
    line: i64,
}

#[derive(Clone, PartialEq, Message)]
struct PprofFunction {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(int64, tag = "2")]
    name: i64,
    #[prost(int64, tag = "4")]
    filename: i64,
}

/// One push as received.
#[derive(Debug, Clone)]
pub struct Push {
    pub at: Instant,
    pub labels: BTreeMap<String, String>,
    pub id: String,
    pub status: u16,
    /// Of the profile: its start (Unix ns) and length.
    pub time_nanos: i64,
    pub duration_nanos: i64,
    /// Each sample's leaf function name and first value.
    pub leaves: Vec<(String, i64)>,
    /// Each sample's function names, root first, and first value.
    pub stacks: Vec<(Vec<String>, i64)>,
    pub headers: BTreeMap<String, String>,
    /// The request it came in (unzipped), and its profile as sent (gzipped
    /// pprof), for other tools to read.
    pub request: Arc<Vec<u8>>,
    pub raw_profile: Vec<u8>,
}

impl Push {
    pub fn label(&self, name: &str) -> &str {
        self.labels.get(name).map_or("", String::as_str)
    }

    /// The function with the most of the profile's first value at the leaf.
    pub fn hottest(&self) -> String {
        let mut by: BTreeMap<&str, i64> = BTreeMap::new();
        for (f, v) in &self.leaves {
            *by.entry(f.as_str()).or_default() += v;
        }
        by.into_iter()
            .max_by_key(|(_, v)| *v)
            .map(|(f, _)| f.to_string())
            .unwrap_or_default()
    }
}

#[derive(Default)]
struct State {
    pushes: Vec<Push>,
    /// Answers for the next requests of one process: (status, body); then 200.
    script: VecDeque<(u16, String)>,
    script_pid: String,
    /// Answer every request with this, once the script is done.
    always: Option<(u16, String)>,
    down: bool,
    handshake_failures: Vec<String>,
}

pub struct Receiver {
    pub port: u16,
    state: Arc<Mutex<State>>,
    tls: bool,
}

type Tls = Option<Arc<rustls::ServerConfig>>;

impl Receiver {
    pub fn start() -> Receiver {
        Self::serving(None)
    }

    /// Served over TLS with the certificate chain and key in these PEM files.
    pub fn start_tls(chain: &Path, key: &Path) -> Receiver {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let chain: Vec<CertificateDer> = CertificateDer::pem_file_iter(chain)
            .expect("the certificate chain")
            .collect::<Result<_, _>>()
            .expect("PEM certificates");
        let key = PrivateKeyDer::from_pem_file(key).expect("the key");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .expect("a certificate and its key");
        Self::serving(Some(Arc::new(config)))
    }

    fn serving(tls: Tls) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the receiver");
        let port = listener.local_addr().expect("its port").port();
        let state = Arc::new(Mutex::new(State::default()));
        let s = Arc::clone(&state);
        let with_tls = tls.is_some();
        std::thread::spawn(move || accept(listener, port, tls, &s));
        Receiver {
            port,
            state,
            tls: with_tls,
        }
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// TLS handshakes that failed, with why (as the server saw it).
    pub fn handshake_failures(&self) -> Vec<String> {
        self.state.lock().unwrap().handshake_failures.clone()
    }

    pub fn pushes(&self) -> Vec<Push> {
        self.state.lock().unwrap().pushes.clone()
    }

    /// The next answers to process `pid`'s pushes, in order (then 200
    /// again). Other Rubies on the host are pushed too.
    pub fn script(&self, pid: u32, answers: &[(u16, &str)]) {
        let mut s = self.state.lock().unwrap();
        s.script = answers.iter().map(|(c, b)| (*c, b.to_string())).collect();
        s.script_pid = pid.to_string();
    }

    pub fn always(&self, status: u16, body: &str) {
        self.state.lock().unwrap().always = Some((status, body.to_string()));
    }

    /// Down: connections refused (the port closed) until `up`.
    pub fn down(&self) {
        self.state.lock().unwrap().down = true;
    }

    pub fn up(&self) {
        self.state.lock().unwrap().down = false;
    }

    /// Waits until `pred` holds of the pushes received.
    pub fn wait_for(&self, what: &str, timeout: Duration, pred: impl Fn(&[Push]) -> bool) -> Vec<Push> {
        let deadline = Instant::now() + timeout;
        loop {
            let pushes = self.pushes();
            if pred(&pushes) {
                return pushes;
            }
            assert!(
                Instant::now() < deadline,
                "no {what} in {timeout:?}: {} pushes: {pushes:#?}",
                pushes.len()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Accepts while up; while down the port is closed, and opened again on
/// the same port when up.
fn accept(listener: TcpListener, port: u16, tls: Tls, state: &Arc<Mutex<State>>) {
    let mut listener = Some(listener);
    loop {
        let down = state.lock().unwrap().down;
        match (down, &listener) {
            (true, Some(_)) => listener = None,
            (false, None) => {
                listener = TcpListener::bind(("127.0.0.1", port)).ok();
                continue;
            }
            (true, None) => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            (false, Some(l)) => {
                l.set_nonblocking(true).unwrap();
                match l.accept() {
                    Ok((conn, _)) => {
                        let s = Arc::clone(state);
                        let tls = tls.clone();
                        std::thread::spawn(move || serve_connection(conn, tls, &s));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        }
    }
}

fn serve_connection(conn: TcpStream, tls: Tls, state: &Arc<Mutex<State>>) {
    conn.set_nonblocking(false).unwrap();
    let Some(config) = tls else {
        return serve(conn, state);
    };
    let mut conn = rustls::StreamOwned::new(rustls::ServerConnection::new(config).unwrap(), conn);
    while conn.conn.is_handshaking() {
        if let Err(e) = conn.conn.complete_io(&mut conn.sock) {
            state.lock().unwrap().handshake_failures.push(e.to_string());
            return;
        }
    }
    serve(conn, state)
}

/// Requests on one connection (kept alive) until it closes, or the
/// receiver goes down.
fn serve<S: Read + Write>(conn: S, state: &Arc<Mutex<State>>) {
    let mut reader = BufReader::new(conn);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut headers = BTreeMap::new();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
            }
        }
        let len: usize = headers
            .get("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0u8; len];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        if state.lock().unwrap().down {
            return; // no answer: the connection just closes
        }
        let (status, answer) = handle(&line, &headers, &body, state);
        let reply = format!(
            "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{answer}",
            answer.len()
        );
        let out = reader.get_mut();
        if out
            .write_all(reply.as_bytes())
            .and_then(|()| out.flush())
            .is_err()
        {
            return;
        }
    }
}

fn connect_error(code: &str, message: &str) -> String {
    format!("{{\"code\":\"{code}\",\"message\":\"{message}\"}}")
}

fn gunzip(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(b)
        .read_to_end(&mut out)
        .expect("gzip");
    out
}

/// One request: decoded and checked as Pyroscope would, recorded, and
/// answered as scripted.
fn handle(
    line: &str,
    headers: &BTreeMap<String, String>,
    body: &[u8],
    state: &Arc<Mutex<State>>,
) -> (u16, String) {
    assert!(line.starts_with("POST /push.v1.PusherService/Push "), "{line}");
    assert_eq!(
        headers.get("content-type").map(String::as_str),
        Some("application/proto")
    );
    let raw = if headers.get("content-encoding").map(String::as_str) == Some("gzip") {
        gunzip(body)
    } else {
        body.to_vec()
    };
    let req = PushRequest::decode(&raw[..]).expect("a PushRequest");
    let request = Arc::new(raw);
    let mut s = state.lock().unwrap();
    let mut answer = (200, String::new());
    for series in &req.series {
        let labels: BTreeMap<String, String> = series
            .labels
            .iter()
            .map(|l| (l.name.clone(), l.value.clone()))
            .collect();
        let scripted = match labels.get("pid") {
            Some(pid) if *pid == s.script_pid => s.script.pop_front(),
            _ => None,
        }
        .or_else(|| s.always.clone());
        let sorted = series.labels.windows(2).all(|w| w[0].name < w[1].name);
        if let Some(why) = invalid_labels(&labels, sorted) {
            answer = (400, connect_error("invalid_argument", &why));
        }
        for sample in &series.samples {
            let p = PprofProfile::decode(&gunzip(&sample.raw_profile)[..]).expect("a pprof profile");
            if let Some(why) = invalid_profile(&p) {
                answer = (400, connect_error("invalid_argument", &why));
            }
            if let Some(a) = &scripted {
                answer = a.clone();
            }
            s.pushes.push(Push {
                at: Instant::now(),
                labels: labels.clone(),
                id: sample.id.clone(),
                status: answer.0,
                time_nanos: p.time_nanos,
                duration_nanos: p.duration_nanos,
                leaves: leaves(&p),
                stacks: stacks(&p),
                headers: headers.clone(),
                request: Arc::clone(&request),
                raw_profile: sample.raw_profile.clone(),
            });
        }
    }
    answer
}

/// Pyroscope 1.x's label rules (`ValidateLabels`).
fn invalid_labels(labels: &BTreeMap<String, String>, sorted: bool) -> Option<String> {
    if !sorted {
        return Some("labels not sorted".to_string());
    }
    for name in labels.keys() {
        let mut c = name.chars();
        let ok = c.next().is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
            && c.all(|x| x.is_ascii_alphanumeric() || x == '_');
        if !ok {
            return Some(format!("invalid label name {name:?}"));
        }
    }
    if labels.get("service_name").is_none_or(String::is_empty) || !labels.contains_key("__name__") {
        return Some("service_name and __name__ are required".to_string());
    }
    (labels.len() > 30).then(|| "too many labels".to_string())
}

/// Pyroscope's profile checks (`ValidateProfile`): the ones rprof could break.
fn invalid_profile(p: &PprofProfile) -> Option<String> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as i64;
    if p.sample.len() > 16_000 {
        return Some(format!("{} samples, over 16000", p.sample.len()));
    }
    if p.time_nanos > 0 && (p.time_nanos < now - 3_600_000_000_000 || p.time_nanos > now + 600_000_000_000) {
        return Some("profile outside the ingestion window".to_string());
    }
    (p.string_table.first().map(String::as_str) != Some(""))
        .then(|| "string table must start empty".to_string())
}

/// Each sample's leaf function and first value.
fn leaves(p: &PprofProfile) -> Vec<(String, i64)> {
    p.sample
        .iter()
        .map(|s| {
            let name = s
                .location_id
                .first()
                .and_then(|&l| frame(p, l))
                .map(|(name, _)| name);
            (name.unwrap_or_default(), s.value.first().copied().unwrap_or(0))
        })
        .collect()
}

/// Each sample's frames as a folded file has them (`name (file:line)`),
/// root first.
fn stacks(p: &PprofProfile) -> Vec<(Vec<String>, i64)> {
    let folded = |&loc: &u64| -> String {
        match frame(p, loc) {
            Some((name, Some((file, line)))) => format!("{name} ({file}:{line})"),
            Some((name, None)) => name,
            None => String::new(),
        }
    };
    p.sample
        .iter()
        .map(|s| {
            (
                s.location_id.iter().rev().map(folded).collect(),
                s.value.first().copied().unwrap_or(0),
            )
        })
        .collect()
}

/// A location's function name, and its file and line if it has a file.
fn frame(p: &PprofProfile, loc: u64) -> Option<(String, Option<(String, i64)>)> {
    let line = p.location.iter().find(|l| l.id == loc)?.line.first()?;
    let f = p.function.iter().find(|f| f.id == line.function_id)?;
    let text = |i: i64| p.string_table.get(i as usize).cloned().unwrap_or_default();
    let file = text(f.filename);
    Some((text(f.name), (!file.is_empty()).then_some((file, line.line))))
}
