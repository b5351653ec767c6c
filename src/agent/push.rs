//! Pushing to Pyroscope: Connect's unary `push.v1.PusherService/Push` over
//! HTTP (what the `pyroscope` gem and Grafana Alloy send), from a thread of
//! its own behind a bounded queue. A server that is down, slow or throttling
//! costs retries with backoff and, once the queue is full, dropped profiles
//! (counted), never memory or the recording's time.

use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use flate2::write::GzEncoder;
use prost::Message;

/// `push.v1.PushRequest` (field numbers from Pyroscope's push.proto).
#[derive(Clone, PartialEq, Message)]
struct PushRequest {
    #[prost(message, repeated, tag = "1")]
    series: Vec<RawProfileSeries>,
}

#[derive(Clone, PartialEq, Message)]
struct RawProfileSeries {
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
    /// A pprof profile, gzipped.
    #[prost(bytes = "vec", tag = "1")]
    raw_profile: Vec<u8>,
    #[prost(string, tag = "2")]
    id: String,
}

/// Where profiles go, and as whom.
pub struct Endpoint {
    /// `BASE/push.v1.PusherService/Push`.
    pub url: String,
    /// (user, password)
    pub basic_auth: Option<(String, String)>,
    /// `X-Scope-OrgID`
    pub tenant: Option<String>,
}

/// One process's profile of one interval, labelled.
pub struct Profile {
    pub labels: Vec<(String, String)>,
    /// Gzipped pprof.
    pub pprof: Vec<u8>,
    /// When its interval started, Unix nanoseconds.
    pub start_ns: u64,
}

/// What the sender has done, for the agent's minute line.
#[derive(Default)]
pub struct Stats {
    pub ok: AtomicU64,
    /// Given up: refused as invalid, or still failing after every retry.
    pub failed: AtomicU64,
    pub retried: AtomicU64,
    /// Never sent: the queue was full, or the profile grew too old waiting.
    pub dropped: AtomicU64,
    /// Request bodies the server took.
    pub bytes: AtomicU64,
    /// The last failure, as the server (or the connection) said it.
    pub last_error: Mutex<Option<String>>,
}

/// Profiles waiting to be sent, at most this many bytes of them: a server
/// down for hours costs no more memory than this.
const MAX_QUEUED_BYTES: usize = 32 << 20;
const MAX_QUEUED: usize = 1024;
/// Tries per profile (Grafana Alloy's default: 10), the first wait, and the
/// longest (doubling between).
const MAX_TRIES: u32 = 10;
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Pyroscope refuses a profile older than an hour: one that waited longer
/// (minus a margin for clocks) is dropped, not sent.
const MAX_AGE: Duration = Duration::from_secs(55 * 60);
/// Pyroscope's SDKs wait 10 s for an answer.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The sending thread, and the queue in front of it.
pub struct Sender {
    tx: Option<SyncSender<Profile>>,
    /// Bytes and profiles in the queue.
    queued: Arc<AtomicUsize>,
    waiting: Arc<AtomicUsize>,
    pub stats: Arc<Stats>,
    thread: Option<JoinHandle<()>>,
}

impl Sender {
    pub fn start(endpoint: Endpoint) -> Result<Self> {
        // RPROF_PUSH_QUEUE: fewer profiles queued (the tests fill it).
        let capacity = std::env::var("RPROF_PUSH_QUEUE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(MAX_QUEUED);
        let (tx, rx) = sync_channel(capacity);
        let queued = Arc::new(AtomicUsize::new(0));
        let waiting = Arc::new(AtomicUsize::new(0));
        let stats = Arc::new(Stats::default());
        let client = Client::new(endpoint);
        let (q, w, s) = (Arc::clone(&queued), Arc::clone(&waiting), Arc::clone(&stats));
        let thread = std::thread::Builder::new()
            .name("rprof-push".to_string())
            .spawn(move || send_all(&client, &rx, (&q, &w), &s))
            .context("starting the push thread")?;
        Ok(Self {
            tx: Some(tx),
            queued,
            waiting,
            stats,
            thread: Some(thread),
        })
    }

    /// Queues a profile, or drops it (counted) if the queue is full.
    pub fn push(&self, p: Profile) {
        let size = p.pprof.len();
        let Some(tx) = &self.tx else { return };
        if self.queued.load(Ordering::Relaxed) + size > MAX_QUEUED_BYTES {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.queued.fetch_add(size, Ordering::Relaxed);
        self.waiting.fetch_add(1, Ordering::Relaxed);
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = tx.try_send(p) {
            self.queued.fetch_sub(size, Ordering::Relaxed);
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// No more profiles: sends what is queued, for at most `wait`; what is
    /// left then is counted as dropped.
    pub fn close(&mut self, wait: Duration) {
        self.tx = None;
        let deadline = Instant::now() + wait;
        while self.thread.as_ref().is_some_and(|t| !t.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        match self.thread.take() {
            Some(t) if t.is_finished() => {
                let _ = t.join();
            }
            // Still sending: it ends with rprof, and what waits is dropped.
            Some(_) => {
                let left = self.waiting.load(Ordering::Relaxed) as u64;
                self.stats.dropped.fetch_add(left, Ordering::Relaxed);
            }
            None => {}
        }
    }
}

/// The push thread: each profile in turn, until the queue is closed.
/// (`queued`: the queue's bytes and profiles, the one being sent included.)
fn send_all(client: &Client, rx: &Receiver<Profile>, queued: (&AtomicUsize, &AtomicUsize), stats: &Stats) {
    while let Ok(p) = rx.recv() {
        queued.0.fetch_sub(p.pprof.len(), Ordering::Relaxed);
        client.send(&p, stats);
        queued.1.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How a push ended.
enum Outcome {
    Sent,
    /// Worth trying again: the server is down, slow, or throttling.
    Retry(String),
    /// Refused for good (invalid, unauthenticated): never sent again.
    Refused(String),
}

struct Client {
    agent: ureq::Agent,
    endpoint: Endpoint,
}

impl Client {
    fn new(endpoint: Endpoint) -> Self {
        let tls = ureq::tls::TlsConfig::builder()
            .root_certs(ureq::tls::RootCerts::PlatformVerifier)
            .build();
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(TIMEOUT))
            .http_status_as_error(false)
            .tls_config(tls)
            .user_agent(concat!("rprof/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Self { agent, endpoint }
    }

    /// Sends one profile, retrying with backoff while that may help.
    fn send(&self, p: &Profile, stats: &Stats) {
        let body = match request_body(p) {
            Ok(b) => b,
            Err(e) => return failed(stats, format!("encoding a push: {e}")),
        };
        let mut wait = FIRST_BACKOFF;
        for attempt in 1..=MAX_TRIES {
            if age(p.start_ns) > MAX_AGE {
                stats.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            match self.post(&body) {
                Outcome::Sent => {
                    stats.ok.fetch_add(1, Ordering::Relaxed);
                    stats.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
                    return;
                }
                Outcome::Refused(why) => return failed(stats, why),
                Outcome::Retry(why) if attempt == MAX_TRIES => return failed(stats, why),
                Outcome::Retry(why) => {
                    stats.retried.fetch_add(1, Ordering::Relaxed);
                    *lock(&stats.last_error) = Some(why);
                    // Up to a quarter more, at random: agents restarted together
                    // do not retry together.
                    std::thread::sleep(wait + wait.mul_f64(fastrand::f64() / 4.0));
                    wait = (wait * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    fn post(&self, body: &[u8]) -> Outcome {
        let e = &self.endpoint;
        let mut req = self
            .agent
            .post(&e.url)
            .header("Content-Type", "application/proto")
            .header("Content-Encoding", "gzip");
        if let Some((user, password)) = &e.basic_auth {
            req = req.header("Authorization", basic(user, password));
        }
        if let Some(t) = &e.tenant {
            req = req.header("X-Scope-OrgID", t);
        }
        let mut resp = match req.send(body) {
            Ok(r) => r,
            Err(err) => return Outcome::Retry(format!("{}: {err}", e.url)),
        };
        let status = resp.status().as_u16();
        if (200..300).contains(&status) {
            return Outcome::Sent;
        }
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        let why = format!("{} answered {status}: {}", e.url, connect_message(&text));
        // Connect's codes as HTTP: resource_exhausted 429, unavailable 503,
        // internal/unknown 500, deadline 408/504: retry; invalid_argument
        // 400, unauthenticated 401, permission_denied 403: do not.
        if status == 408 || status == 429 || status >= 500 {
            Outcome::Retry(why)
        } else {
            Outcome::Refused(why)
        }
    }
}

fn failed(stats: &Stats, why: String) {
    stats.failed.fetch_add(1, Ordering::Relaxed);
    *lock(&stats.last_error) = Some(why);
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How long ago `start_ns` (Unix nanoseconds) was.
fn age(start_ns: u64) -> Duration {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    now.saturating_sub(Duration::from_nanos(start_ns))
}

/// A Connect error's message (`{"code":"...","message":"..."}`), else the
/// body as it came (cut short).
fn connect_message(body: &str) -> String {
    #[derive(serde::Deserialize)]
    struct ConnectError {
        code: Option<String>,
        message: Option<String>,
    }
    match serde_json::from_str::<ConnectError>(body) {
        Ok(ConnectError { code, message }) => {
            format!("{} ({})", message.unwrap_or_default(), code.unwrap_or_default())
        }
        Err(_) => body.chars().take(200).collect(),
    }
}

/// `Basic base64(user:password)`.
fn basic(user: &str, password: &str) -> String {
    use base64::Engine;
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    format!("Basic {encoded}")
}

/// The PushRequest of one profile, gzipped: a series with its labels
/// (sorted, as Pyroscope wants them) and one sample.
fn request_body(p: &Profile) -> Result<Vec<u8>> {
    let mut labels: Vec<LabelPair> = p
        .labels
        .iter()
        .map(|(name, value)| LabelPair {
            name: name.clone(),
            value: value.clone(),
        })
        .collect();
    labels.sort_by(|a, b| a.name.cmp(&b.name));
    let request = PushRequest {
        series: vec![RawProfileSeries {
            labels,
            samples: vec![RawSample {
                raw_profile: p.pprof.clone(),
                id: profile_id(),
            }],
        }],
    };
    let mut gz = GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&request.encode_to_vec())?;
    Ok(gz.finish()?)
}

/// A random UUID (version 4), the profile's ID.
fn profile_id() -> String {
    let mut b: [u8; 16] = std::array::from_fn(|_| fastrand::u8(..));
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The encoding against a vector computed by hand from the field numbers
    /// (../shared/notes/fleet-backends.md §1.2).
    #[test]
    fn push_request_encoding() {
        let r = PushRequest {
            series: vec![RawProfileSeries {
                labels: vec![
                    LabelPair {
                        name: "__name__".into(),
                        value: "process_cpu".into(),
                    },
                    LabelPair {
                        name: "service_name".into(),
                        value: "demo".into(),
                    },
                ],
                samples: vec![RawSample {
                    raw_profile: vec![0x1f, 0x8b],
                    id: "id-1".into(),
                }],
            }],
        };
        let hex: String = r.encode_to_vec().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "0a3b0a170a085f5f6e616d655f5f120b70726f636573735f6370750a140a0c736572766963655f6e616d65120464656d6f120a0a021f8b120469642d31"
        );
    }

    #[test]
    fn basic_auth_header() {
        assert_eq!(
            basic("Aladdin", "open sesame"),
            "Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ=="
        );
        assert_eq!(basic("a", "b"), "Basic YTpi");
    }
}
