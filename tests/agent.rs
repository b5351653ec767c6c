//! `rprof agent`: every Ruby on the host, one profile per process per
//! interval, pushed to a Pyroscope receiver (tests/agent/receiver.rs) that
//! checks each push as Pyroscope does, and fails or stays silent on demand.

use crate::common;
#[path = "agent/receiver.rs"]
pub mod receiver;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{Ruby, Target, RPROF};
use receiver::{Push, Receiver};

/// `rprof agent --push URL --interval 1s ARGS`, once it records.
struct Agent {
    child: Child,
    stderr: BufReader<ChildStderr>,
}

impl Agent {
    fn start(url: &str, args: &[&str], env: &[(&str, &str)]) -> Agent {
        let mut agent = Self::spawn(url, args, env);
        agent.wait_recording();
        agent
    }

    /// `start`, not waiting until it records.
    fn spawn(url: &str, args: &[&str], env: &[(&str, &str)]) -> Agent {
        let mut child = Command::new(RPROF)
            .args(["agent", "--push", url, "--interval", "1s"])
            .args(args)
            .envs(env.iter().copied())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start rprof agent");
        let stderr = BufReader::new(child.stderr.take().expect("stderr"));
        Agent { child, stderr }
    }

    fn wait_recording(&mut self) {
        let mut line = String::new();
        while !line.contains("rprof: recording") {
            line.clear();
            assert!(
                self.stderr.read_line(&mut line).expect("stderr") > 0,
                "the agent ended"
            );
        }
    }

    /// Ctrl-C; its last line of what it pushed (`rprof: agent: ...`).
    fn stop(mut self) -> String {
        // SAFETY: SIGINT to a child we started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let status = self.child.wait().expect("the agent ends");
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stderr, &mut rest).expect("stderr");
        assert!(status.success(), "{rest}");
        assert!(!rest.contains("panicked"), "{rest}");
        let line = rest.lines().rev().find(|l| l.starts_with("rprof: agent: "));
        line.unwrap_or_else(|| panic!("no agent line in {rest}"))
            .to_string()
    }

    fn rss_kib(&self) -> u64 {
        self.status_kib("VmRSS")
    }

    /// A memory figure of `/proc/PID/status` (`VmHWM`, `RssAnon`...), in KiB.
    fn status_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).expect("status");
        let line = status
            .lines()
            .find(|l| l.strip_prefix(field).is_some_and(|rest| rest.starts_with(':')))
            .unwrap_or_else(|| panic!("no {field} in {status}"));
        line.split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .expect("a number")
    }
}

fn unix_now_ns() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as i64
}

fn of_pid(pushes: &[Push], pid: u32) -> Vec<&Push> {
    pushes
        .iter()
        .filter(|p| p.label("pid") == pid.to_string())
        .collect()
}

/// A spinning Ruby (`Object#spin`), with the environment given.
fn spinner(ruby: &Ruby, env: &[(&str, &str)], dir: Option<&std::path::Path>) -> Target {
    let mut cmd = ruby.command("alloc_work.rb", &["1", "spin"]);
    cmd.envs(env.iter().copied());
    if let Some(d) = dir {
        cmd.current_dir(d);
    }
    Target::start(&mut cmd)
}

/// Three Rubies, two before the agent and one after, each pushed every
/// interval under its own service name and PID with its hot method; one
/// that exits is pushed no more; one excluded is never pushed.
#[test]
fn every_ruby_pushed_under_its_own_labels() {
    let server = Receiver::start();
    let app = tempfile::Builder::new()
        .prefix("shopapp")
        .tempdir()
        .expect("tempdir");
    let alpha = spinner(&Ruby::host(), &[("PYROSCOPE_APPLICATION_NAME", "alpha")], None);
    let shop = spinner(&Ruby::host(), &[], Some(app.path()));
    let hidden = spinner(&Ruby::host(), &[("PYROSCOPE_APPLICATION_NAME", "hidden")], None);
    let token = app.path().join("token");
    std::fs::write(&token, "s3cret\n").expect("write the password");
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
    let agent = Agent::start(
        &server.url(),
        &[
            "--label",
            "env=test",
            "--exclude",
            "hidden",
            "--tenant",
            "team-a",
            "--basic-auth-user",
            "123",
            "--basic-auth-password-file",
            token.to_str().unwrap(),
        ],
        &[],
    );
    let beta = spinner(&Ruby::named("3.4"), &[("OTEL_SERVICE_NAME", "beta")], None);
    let shop_name = app.path().file_name().unwrap().to_str().unwrap().to_string();
    let pushes = server.wait_for("three pushes of each", Duration::from_secs(30), |p| {
        [alpha.pid, shop.pid, beta.pid]
            .iter()
            .all(|&pid| of_pid(p, pid).len() >= 3)
    });
    for (t, name) in [(&alpha, "alpha"), (&shop, shop_name.as_str()), (&beta, "beta")] {
        let mine = of_pid(&pushes, t.pid);
        for p in &mine {
            assert_eq!(p.label("service_name"), name, "{p:#?}");
            assert_eq!(p.label("__name__"), "process_cpu", "{p:#?}");
            assert_eq!(p.label("env"), "test", "{p:#?}");
            assert!(!p.label("hostname").is_empty(), "{p:#?}");
            assert_eq!(p.status, 200, "the receiver refused it: {p:#?}");
            assert_eq!(p.hottest(), "Object#spin", "{p:#?}");
            assert!(
                (500_000_000..=2_000_000_000).contains(&p.duration_nanos),
                "{p:#?}"
            );
            let header = |h: &str| p.headers.get(h).map(String::as_str);
            assert_eq!(header("x-scope-orgid"), Some("team-a"));
            // base64("123:s3cret")
            assert_eq!(header("authorization"), Some("Basic MTIzOnMzY3JldA=="));
            assert_eq!(header("content-encoding"), Some("gzip"));
        }
        // One profile per interval (within the 0.5 s an epoch takes), each
        // starting exactly where the last ended: both are dated by the
        // recording's clock. (They were dated when flushed, from a start
        // taken before the agent's set-up: 2-3 s early beside three CPU
        // burners, 10 runs of 10.)
        for w in mine.windows(2) {
            let gap = w[1].time_nanos - w[0].time_nanos;
            assert!((500_000_000..=2_000_000_000).contains(&gap), "{:#?}", w);
            assert_eq!(gap, w[0].duration_nanos, "not contiguous: {:#?}", w);
        }
    }
    assert!(
        of_pid(&pushes, hidden.pid).is_empty(),
        "--exclude hidden: pushed all the same"
    );
    read_by_other_tools(of_pid(&pushes, alpha.pid)[0]);
    let gone = alpha.pid;
    drop(alpha); // killed
    let ended_at = unix_now_ns();
    server.wait_for("two more intervals of the others", Duration::from_secs(15), |p| {
        of_pid(p, beta.pid)
            .iter()
            .filter(|x| x.time_nanos > ended_at)
            .count()
            >= 2
    });
    let late: Vec<Push> = of_pid(&server.pushes(), gone)
        .into_iter()
        .filter(|p| p.time_nanos > ended_at)
        .cloned()
        .collect();
    assert!(late.is_empty(), "pushed after it ended: {late:#?}");
    let said = agent.stop();
    assert!(
        said.contains(" 0 failed") && said.contains(" 0 dropped"),
        "{said}"
    );
}

/// A push as protoc and go tool pprof read it, not only as the receiver's
/// own message definitions do: `protoc --decode_raw` finds the series's
/// labels and the profile's ID at the field numbers Pyroscope's push.v1
/// gives them; `go tool pprof` reads the profile, whose hottest function is
/// the spinner's.
fn read_by_other_tools(push: &Push) {
    let dir = tempfile::tempdir().expect("tempdir");
    let request = dir.path().join("push.bin");
    std::fs::write(&request, &push.request[..]).expect("write the request");
    let out = Command::new("protoc")
        .arg("--decode_raw")
        .stdin(std::fs::File::open(&request).expect("the request"))
        .output()
        .expect("protoc (Debian's protobuf-compiler; make test installs it)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "protoc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // PushRequest.series = 1 { labels = 1 { name = 1, value = 2 },
    // samples = 2 { raw_profile = 1, id = 2 } }: each a field path.
    let mut fields = Vec::new();
    let mut path: Vec<&str> = Vec::new();
    for line in text.lines().map(str::trim) {
        if let Some(open) = line.strip_suffix(" {") {
            path.push(open);
        } else if line == "}" {
            path.pop();
        } else if let Some((n, v)) = line.split_once(": ") {
            fields.push((format!("{}.{n}", path.join(".")), v.trim_matches('"').to_string()));
        }
    }
    let pairs: Vec<(&str, &str)> = fields
        .windows(2)
        .filter(|w| w[0].0 == "1.1.1" && w[1].0 == "1.1.2")
        .map(|w| (w[0].1.as_str(), w[1].1.as_str()))
        .collect();
    for (name, value) in [
        ("__name__", "process_cpu"),
        ("service_name", push.label("service_name")),
        ("pid", push.label("pid")),
    ] {
        assert!(
            pairs.contains(&(name, value)),
            "{name}={value} not in {pairs:?}:\n{text}"
        );
    }
    assert!(
        fields.contains(&("1.2.2".to_string(), push.id.clone())),
        "the profile's ID {} not at series.samples.id:\n{text}",
        push.id
    );
    let profile = dir.path().join("profile.pb.gz");
    std::fs::write(&profile, &push.raw_profile).expect("write the profile");
    let top = common::go_pprof(&profile, &["-top"]);
    let first = top
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("flat"))
        .nth(1)
        .unwrap_or_default();
    assert!(first.ends_with("Object#spin"), "go tool pprof -top:\n{top}");
}

/// The server down for 30 s, then up: the agent keeps recording, its memory
/// stays put, what could not be queued is dropped and counted, and the
/// pushes after the recovery carry the new intervals.
#[test]
fn a_server_down_then_up() {
    let server = Receiver::start();
    let ruby = spinner(&Ruby::host(), &[], None);
    let agent = Agent::start(&server.url(), &[], &[("RPROF_PUSH_QUEUE", "4")]);
    server.wait_for("a first push", Duration::from_secs(20), |p| {
        !of_pid(p, ruby.pid).is_empty()
    });
    let rss_before = agent.rss_kib();
    server.down();
    let down_at = Instant::now();
    std::thread::sleep(Duration::from_secs(30));
    let rss_down = agent.rss_kib();
    let up_at = unix_now_ns();
    server.up();
    let _ = down_at;
    let pushes = server.wait_for(
        "pushes of intervals after the recovery",
        Duration::from_secs(60),
        |p| {
            of_pid(p, ruby.pid)
                .iter()
                .filter(|x| x.time_nanos > up_at)
                .count()
                >= 2
        },
    );
    assert!(of_pid(&pushes, ruby.pid).iter().all(|p| p.status == 200));
    // 30 profiles made while down, 4 queued at most (and the one retried).
    let said = agent.stop();
    let dropped: u64 = said
        .split(", ")
        .find_map(|w| w.strip_suffix(" dropped"))
        .and_then(|n| n.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no dropped count in {said}"));
    assert!(dropped >= 20, "{said}");
    // Measured: flat (the queue holds 4 profiles of a few KiB).
    assert!(
        rss_down < rss_before + 20 * 1024,
        "RSS {rss_before} KiB -> {rss_down} KiB"
    );
}

/// A Ruby whose executable is a 256 MiB file (Debian's ruby with a hole
/// appended), started beside the agent: it is found and pushed, and the
/// agent's memory, its peak or what it keeps, does not grow with the file.
/// The agent looks into every program that execs on the host; it maps the
/// files it looks into, where it once read each whole (rustdoc's 100 MB
/// library, exec'd beside it, left it 20 MB bigger for good).
#[test]
fn a_big_executable_costs_the_agent_nothing() {
    const PADDING: u64 = 256 << 20;
    let server = Receiver::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = dir.path().join("ruby-padded");
    let ruby = Ruby::host()
        .interpreter(&["-e", "print RbConfig.ruby"])
        .output()
        .expect("ruby");
    std::fs::copy(String::from_utf8_lossy(&ruby.stdout).as_ref(), &exe).expect("copy ruby");
    let file = std::fs::OpenOptions::new()
        .append(true)
        .open(&exe)
        .expect("open the copy");
    let len = file.metadata().expect("size").len();
    file.set_len(len + PADDING).expect("pad the copy");
    drop(file);
    let padded = Ruby {
        exe: exe.display().to_string(),
        ..Ruby::host()
    };
    let agent = Agent::start(&server.url(), &[], &[]);
    let (peak, kept) = (agent.status_kib("VmHWM"), agent.status_kib("RssAnon"));
    let target = spinner(&padded, &[], None);
    server.wait_for("a push of the padded Ruby", Duration::from_secs(20), |p| {
        of_pid(p, target.pid).iter().any(|p| p.hottest() == "Object#spin")
    });
    let (peak_after, kept_after) = (agent.status_kib("VmHWM"), agent.status_kib("RssAnon"));
    // Measured (3 runs): +1.3 to 1.6 MiB of peak and +0.7 MiB of anonymous
    // memory; reading the file whole made it +228 MiB of peak.
    assert!(
        peak_after < peak + 16 * 1024,
        "the agent's peak RSS: {peak} KiB -> {peak_after} KiB"
    );
    assert!(
        kept_after < kept + 16 * 1024,
        "the agent's anonymous RSS: {kept} KiB -> {kept_after} KiB"
    );
    agent.stop();
}

/// 429 twice, then 200: the same profile, retried with backoff (0.5 s, then
/// 1 s, each up to a quarter more).
#[test]
fn throttled_then_accepted() {
    let server = Receiver::start();
    let ruby = spinner(&Ruby::host(), &[], None);
    server.script(
        ruby.pid,
        &[(429, "{\"code\":\"resource_exhausted\",\"message\":\"slow down\"}"); 2],
    );
    let agent = Agent::start(&server.url(), &[], &[]);
    let pushes = server.wait_for("an accepted push", Duration::from_secs(30), |p| {
        of_pid(p, ruby.pid).iter().any(|x| x.status == 200)
    });
    let mine = of_pid(&pushes, ruby.pid);
    let first = &mine[0];
    let tries: Vec<&&Push> = mine.iter().filter(|p| p.id == first.id).collect();
    assert_eq!(
        tries.iter().map(|p| p.status).collect::<Vec<_>>(),
        [429, 429, 200],
        "{mine:#?}"
    );
    let gaps = [tries[1].at - tries[0].at, tries[2].at - tries[1].at];
    assert!(
        gaps[0] >= Duration::from_millis(500) && gaps[1] >= Duration::from_millis(1000),
        "{gaps:?}"
    );
    let said = agent.stop();
    assert!(said.contains(" 2 retried"), "{said}");
}

/// A push refused as invalid is said with the server's message, and not
/// sent again.
#[test]
fn an_invalid_push_is_refused_not_retried() {
    let server = Receiver::start();
    server.always(
        400,
        "{\"code\":\"invalid_argument\",\"message\":\"tenant over its label limit\"}",
    );
    let ruby = spinner(&Ruby::host(), &[], None);
    let agent = Agent::start(&server.url(), &[], &[]);
    let pushes = server.wait_for("three refused pushes", Duration::from_secs(30), |p| {
        of_pid(p, ruby.pid).len() >= 3
    });
    let said = agent.stop();
    let mine = of_pid(&pushes, ruby.pid);
    let mut ids: Vec<&str> = mine.iter().map(|p| p.id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(
        ids.len(),
        mine.len(),
        "a refused profile was sent again: {mine:#?}"
    );
    assert!(
        said.contains("tenant over its label limit (invalid_argument)"),
        "{said}"
    );
    assert!(said.contains(" 0 retried"), "{said}");
}

/// A CA and a server certificate it signed for 127.0.0.1, made by openssl
/// in `dir`: (the CA's PEM, the server's certificate, its key).
fn certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("run openssl (apt-get install openssl)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &[
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=rprof test CA",
            ],
        ]
        .concat(),
    );
    openssl(
        &[
            &["req"][..],
            &ec,
            &[
                "-keyout",
                "key.pem",
                "-out",
                "server.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
        ]
        .concat(),
    );
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .expect("write server.ext");
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "server.ext",
        "-out",
        "server.pem",
    ]);
    (dir.join("ca.pem"), dir.join("server.pem"), dir.join("key.pem"))
}

/// Over TLS: the agent verifies the server with the system's roots, which
/// `SSL_CERT_FILE` (as for OpenSSL) replaces with a private CA's.
#[test]
fn pushed_over_tls_to_a_server_its_roots_trust() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, chain, key) = certificates(dir.path());
    let server = Receiver::start_tls(&chain, &key);
    assert!(server.url().starts_with("https://"));
    let ruby = spinner(&Ruby::host(), &[], None);
    let ca = ca.display().to_string();
    let agent = Agent::start(&server.url(), &[], &[("SSL_CERT_FILE", &ca)]);
    let pushes = server.wait_for("a push over TLS", Duration::from_secs(30), |p| {
        of_pid(p, ruby.pid).iter().any(|x| x.status == 200)
    });
    let mine = of_pid(&pushes, ruby.pid);
    assert_eq!(mine[0].hottest(), "Object#spin", "{mine:#?}");
    let said = agent.stop();
    assert!(said.contains(" 0 failed, 0 retried"), "{said}");
    assert_eq!(server.handshake_failures(), Vec::<String>::new());
}

/// A server whose certificate the roots do not vouch for gets nothing: the
/// handshake fails, and the agent says why.
#[test]
fn nothing_pushed_to_a_server_its_roots_do_not_trust() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, chain, key) = certificates(dir.path());
    let server = Receiver::start_tls(&chain, &key);
    let _ruby = spinner(&Ruby::host(), &[], None);
    // It keeps trying for 10 s at the end (LAST_PUSH_WAIT), as for a
    // server that is down: here 1 s.
    let agent = Agent::start(&server.url(), &[], &[("RPROF_LAST_PUSH_WAIT_MS", "1000")]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.handshake_failures().is_empty() {
        assert!(Instant::now() < deadline, "no TLS handshake in 30 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    let said = agent.stop();
    assert!(server.pushes().is_empty(), "{:#?}", server.pushes());
    assert!(
        said.contains("last failure: ") && said.contains("UnknownIssuer"),
        "{said}"
    );
}

/// A cgroup made for a test in cgroup v2's tree (the unified one on a
/// hybrid host), with its parents; removed when dropped, once the processes
/// moved into it have ended.
struct Cgroup {
    made: Vec<PathBuf>,
}

impl Cgroup {
    fn new(path: &str) -> Cgroup {
        let root = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
            .iter()
            .map(Path::new)
            .find(|r| r.join("cgroup.procs").exists())
            .expect("a cgroup v2 tree at /sys/fs/cgroup or /sys/fs/cgroup/unified");
        let mut made = Vec::new();
        let mut dir = root.to_path_buf();
        for part in path.split('/') {
            dir.push(part);
            if !dir.exists() {
                std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
                made.push(dir.clone());
            }
        }
        Cgroup { made }
    }

    fn enter(&self, pid: u32) {
        let leaf = self.made.last().expect("a cgroup made");
        std::fs::write(leaf.join("cgroup.procs"), pid.to_string()).expect("move a process into the cgroup");
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for dir in self.made.iter().rev() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// `--only`/`--exclude` by cgroup, and the container and pod a cgroup path
/// names: a Ruby in `.../kubepods-burstable-podUID.slice/docker-ID.scope`
/// under the test's cgroup is pushed with `container_id` and `pod_uid`; one
/// in an excluded cgroup under it, and one outside it, never are.
#[test]
fn cgroups_choose_and_label_what_is_pushed() {
    let top = format!("rprof-test-{}", std::process::id());
    let id = "0123456789abcdef".repeat(4);
    let uid = "12345678-90ab-cdef-1234-567890abcdef";
    let pod = Cgroup::new(&format!(
        "{top}/kubepods-burstable-pod{}.slice/docker-{id}.scope",
        uid.replace('-', "_")
    ));
    let left_out = Cgroup::new(&format!("{top}/left-out"));
    // Declared after the cgroups: dropped (ended) before them.
    let inside = spinner(&Ruby::host(), &[], None);
    pod.enter(inside.pid);
    let excluded = spinner(&Ruby::host(), &[], None);
    left_out.enter(excluded.pid);
    let outside = spinner(&Ruby::host(), &[], None);
    let server = Receiver::start();
    let only = format!("cgroup:/{top}/");
    let agent = Agent::start(
        &server.url(),
        &["--only", only.as_str(), "--exclude", "cgroup:/left-out"],
        &[],
    );
    let pushes = server.wait_for(
        "three pushes of the Ruby in the pod",
        Duration::from_secs(30),
        |p| of_pid(p, inside.pid).len() >= 3,
    );
    for p in of_pid(&pushes, inside.pid) {
        assert_eq!(p.label("container_id"), id, "{p:#?}");
        assert_eq!(p.label("pod_uid"), uid, "{p:#?}");
        assert_eq!(p.hottest(), "Object#spin", "{p:#?}");
    }
    for (what, t) in [("excluded", &excluded), ("outside --only", &outside)] {
        assert!(of_pid(&pushes, t.pid).is_empty(), "{what}: pushed all the same");
    }
    let said = agent.stop();
    assert!(said.contains(" 0 failed"), "{said}");
}

/// Bad input: one line each, exit 1.
#[test]
fn agent_refuses_bad_input() {
    let dir = tempfile::tempdir().expect("tempdir");
    let open = dir.path().join("token");
    std::fs::write(&open, "secret\n").expect("write");
    let cases: [(&[&str], &str); 3] = [
        (&["agent", "--push", "pyroscope:4040"], "is not a URL"),
        (
            &["agent", "--push", "http://x", "--label", "env"],
            "give NAME=VALUE",
        ),
        (
            &[
                "agent",
                "--push",
                "http://x",
                "--basic-auth-user",
                "u",
                "--basic-auth-password-file",
                open.to_str().unwrap(),
            ],
            "can be read by others (mode 644)",
        ),
    ];
    for (args, says) in cases {
        let out = Command::new(RPROF).args(args).output().expect("run rprof");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// A Puma cluster under load whose worker is killed and re-forked: both
/// workers and the replacement are pushed, each under its own PID and the
/// cluster's service name, with the app's handler as the hot method.
#[test]
fn a_puma_cluster_re_forking_a_worker() {
    let server = Receiver::start();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let scripts = common::scripts_dir();
    let mut puma = Target::start(
        Command::new("puma")
            .arg("-C")
            .arg(scripts.join("puma.rb"))
            .arg(scripts.join("app.ru"))
            .env("PORT", port.to_string())
            .env("RACK_ENV", "none")
            .env("PYROSCOPE_APPLICATION_NAME", "shop"),
    );
    let boot = Duration::from_secs(60);
    let worker = |puma: &mut Target| -> u32 {
        puma.wait_line("worker ", boot)["worker ".len()..]
            .parse()
            .unwrap()
    };
    let first = [worker(&mut puma), worker(&mut puma)];
    let agent = Agent::start(&server.url(), &[], &[]);
    // A connection per request: the workers race to accept each, and kept
    // connections could all go to one worker, leaving the other (or the
    // replacement) idle and unpushed (ci119; servers.rs saw the same).
    let mut wrk = Command::new("wrk")
        .args(["-t2", "-c4", "-d12s", "-H", "Connection: close"])
        .arg(format!("http://127.0.0.1:{port}/"))
        .stdout(Stdio::null())
        .spawn()
        .expect("wrk");
    server.wait_for("pushes of both workers", Duration::from_secs(20), |p| {
        first.iter().all(|&w| !of_pid(p, w).is_empty())
    });
    common::signal(first[0], libc::SIGKILL);
    let killed_at = unix_now_ns();
    let replacement = worker(&mut puma);
    let pushes = server.wait_for("pushes of the replacement", Duration::from_secs(20), |p| {
        !of_pid(p, replacement).is_empty()
    });
    let _ = wrk.wait();
    for pid in [first[0], first[1], replacement] {
        for p in of_pid(&pushes, pid) {
            assert_eq!(p.label("service_name"), "shop", "{p:#?}");
            assert_eq!(p.status, 200, "{p:#?}");
        }
        let hot: Vec<String> = of_pid(&pushes, pid).iter().map(|p| p.hottest()).collect();
        assert!(hot.iter().any(|h| h == "HotApp#handle"), "{pid}: {hot:?}");
    }
    // The killed worker's last profile is of the interval it died in.
    let late = of_pid(&pushes, first[0])
        .into_iter()
        .filter(|p| p.time_nanos > killed_at)
        .count();
    assert_eq!(late, 0);
    agent.stop();
}

/// A setting of a shipped file: the text after `key` on its line.
fn shipped(file: &str, key: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging").join(file);
    let text = std::fs::read_to_string(&path).expect("a shipped file");
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .find_map(|l| Some(l.split_once(key)?.1.trim().to_string()))
        .unwrap_or_else(|| panic!("no {key} in {}", path.display()))
}

/// The agent as shipped, held from its start to the CPU its systemd unit
/// gives it (`CPUQuota=`, which the DaemonSet's `limits.cpu` matches), on a
/// machine a production-shaped Rails app keeps busy (servers.rs's
/// rails_views.ru under Puma, 2 workers x 3 threads, and wrk): in what it
/// pushes of the workers, at most 1% of samples with an `[unknown]` frame,
/// no misnamed frame, and as many samples as the workers' CPU time gives.
/// Measured at 20% (with a CPU-burning loop beside): 1 and 2 of about 1,250
/// samples `[unknown]`; at 10%, 0 to 10 of 1,150 to 1,770 in 6 runs. At 20%
/// alone, 0 to 2 of about 1,520, each worker's samples 0.998 to 1.005 of
/// what its CPU time gives, in 3 runs.
#[test]
fn the_agent_held_to_its_units_cpu_quota_keeps_its_names() {
    let quota = shipped("rprof-agent.service", "CPUQuota=");
    let percent: u32 = quota.trim_end_matches('%').parse().expect("a percentage");
    let limit = shipped("rprof-agent.daemonset.yaml", "limits: {cpu: ");
    assert!(
        limit.starts_with(&format!("{}m,", percent * 10)),
        "the DaemonSet's limit {limit:?} is not the unit's {quota}"
    );
    let how = format!("the agent held to {quota} of a CPU");
    let server = Receiver::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let (_puma, first, mut wrk) = crate::servers::loaded_rails("rails_views.ru", dir.path(), 14);
    // A production app is warm when its agent starts: its views compiled
    // and their code old.
    std::thread::sleep(Duration::from_secs(2));
    let mut agent = Agent::spawn(&server.url(), &[], &[]);
    let _quota = crate::servers::CpuQuota::hold_percent(agent.child.id(), percent);
    agent.wait_recording();
    let watches: Vec<common::CpuWatch> = first
        .iter()
        .map(|w| common::CpuWatch::start(w.parse().expect("a worker's pid")))
        .collect();
    std::thread::sleep(Duration::from_secs(8));
    // The workers stopped, their CPU time is final: the agent's every
    // sample of them since its start is in what it pushes by its end (its
    // last profile flushed then).
    let (stopped, cpu) = common::stop_and_read(&watches);
    let summary = agent.stop();
    let pushes = server.pushes();
    drop(stopped);
    let _ = wrk.wait();
    eprintln!("{how}: {summary}");
    let (mut total, mut unknown) = (0i64, 0i64);
    for (worker, cpu) in first.iter().zip(cpu) {
        let of_worker = of_pid(&pushes, worker.parse().expect("a pid"));
        let pushed: i64 = of_worker.iter().flat_map(|p| &p.stacks).map(|(_, n)| n).sum();
        let pushed = u64::try_from(pushed).expect("a count");
        crate::servers::assert_samples_for_cpu(&how, worker, pushed, (cpu, 99.0), 0.98..=1.03, &summary);
        for p in &of_worker {
            for (stack, n) in &p.stacks {
                total += n;
                if stack.iter().any(|f| f == "[unknown]") {
                    unknown += n;
                }
                let wrong = crate::servers::views_misnamed(stack);
                assert!(
                    wrong.is_empty(),
                    "{how}: misnamed {wrong:?} in {}",
                    stack.join(";")
                );
            }
        }
    }
    eprintln!("{how}: {unknown} of {total} samples with [unknown]");
    assert!(total >= 1_000, "{how}: {total} samples pushed");
    assert!(
        unknown * 100 <= total,
        "{how}: {unknown} of {total} samples with [unknown] frames: {summary}"
    );
}
