//! What rprof writes for a browser, opened in one: the HTML page
//! (`report --open`) and the speedscope file in speedscope's own app
//! (from its npm package, served from a local directory), both in
//! Debian's headless Chromium. Each must load without console errors and
//! show the recording; a screenshot of each is kept (in the test target's
//! directory) for a person to look at.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::rprof;

/// speedscope's app, as `make test-deps` fetches it (scripts/fetch-speedscope.sh).
const SPEEDSCOPE_APP: &str = "/var/cache/rprof/speedscope/app";

fn path(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

fn ok(out: Output) -> (String, String) {
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success() && !stderr.contains("panicked"),
        "failed: {stderr}"
    );
    (stdout, stderr)
}

/// diff_work.rb (`scaled` twice a round) recorded for 2 s into
/// `dir/rec.rprof`.
fn recording(dir: &Path) -> PathBuf {
    let rec = dir.join("rec.rprof");
    common::record_diff_work("2", 2.0, &rec, &[]);
    rec
}

/// Headless Chromium on `url` with `args` (`--dump-dom`, `--screenshot=`):
/// its stdout, and the console messages it logged.
fn chromium(url: &str, args: &[&str]) -> (String, Vec<String>) {
    let out = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--window-size=1280,900",
            "--virtual-time-budget=5000",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .args(args)
        .arg(url)
        .output()
        .expect("chromium (apt install chromium)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "chromium failed: {stderr}");
    let console = stderr
        .lines()
        .filter(|l| l.contains(":CONSOLE"))
        .map(str::to_string)
        .collect();
    (String::from_utf8_lossy(&out.stdout).into_owned(), console)
}

/// Console messages that say something went wrong.
fn errors(console: &[String]) -> Vec<&String> {
    console
        .iter()
        .filter(|l| {
            [
                "Uncaught",
                "Error",
                "error",
                "Failed",
                "Refused",
                "Cannot",
                "undefined",
            ]
            .iter()
            .any(|w| l.contains(w))
        })
        .collect()
}

/// A screenshot of `url`, kept as `name`; its path.
fn screenshot(url: &str, name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("screenshots");
    std::fs::create_dir_all(&dir).expect("screenshots directory");
    let png = dir.join(name);
    let _ = std::fs::remove_file(&png);
    chromium(url, &[&format!("--screenshot={}", path(&png))]);
    let size = std::fs::metadata(&png).map_or(0, |m| m.len());
    assert!(size > 10_000, "{} is {size} bytes", png.display());
    eprintln!("screenshot: {}", png.display());
    png
}

/// The `<title>` of a dumped DOM.
fn title(dom: &str) -> &str {
    let start = dom.find("<title>").map_or(0, |i| i + "<title>".len());
    let end = dom[start..].find("</title>").map_or(start, |i| start + i);
    &dom[start..end]
}

/// `report --open` writes one page and hands it to $BROWSER; Chromium
/// shows its title, the summary with the hot method first, the flame
/// graph's frame, and logs nothing.
#[test]
fn the_html_page_opens_in_chromium() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rec = recording(dir.path());
    let out = Command::new(common::RPROF)
        .args(["report", "-i", path(&rec), "--open"])
        .env("BROWSER", "echo")
        .output()
        .expect("rprof");
    let (stdout, stderr) = ok(out);
    let page = rec.with_extension("html");
    assert_eq!(stdout.trim(), path(&page), "$BROWSER given the page: {stderr}");
    let url = format!("file://{}", path(&page));
    let (dom, console) = chromium(&url, &["--dump-dom"]);
    assert!(
        title(&dom).starts_with("rprof: process ") && title(&dom).ends_with("cpu at 99 Hz"),
        "{}",
        title(&dom)
    );
    let summary = &dom[dom.find("<pre id=\"summary\">").expect("the summary")..];
    let first_row = summary.lines().nth(2).unwrap_or_default();
    assert!(first_row.contains("Object#scaled ("), "{summary}");
    assert!(dom.contains("<iframe id=\"graph\""), "the graph");
    assert!(console.is_empty(), "console: {console:#?}");
    screenshot(&url, "report.html.png");
}

/// The speedscope file in speedscope's app: it imports it (the page is
/// titled after the profile) without errors.
#[test]
fn the_speedscope_file_opens_in_speedscope() {
    let app = Path::new(SPEEDSCOPE_APP);
    assert!(
        app.join("index.html").exists(),
        "speedscope's app is missing: run scripts/fetch-speedscope.sh (make test-deps)"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let rec = recording(dir.path());
    let site = dir.path().join("site");
    std::fs::create_dir(&site).expect("site dir");
    for entry in std::fs::read_dir(app).expect("app dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), site.join(entry.file_name())).expect("copy the app");
    }
    let json = site.join("rec.speedscope.json");
    let (_, stderr) = ok(rprof(&["report", "-i", path(&rec), "-o", path(&json)]));
    let port = serve(site);
    let url =
        format!("http://127.0.0.1:{port}/index.html#profileURL=http://127.0.0.1:{port}/rec.speedscope.json");
    let (dom, console) = chromium(&url, &["--dump-dom"]);
    let t = title(&dom);
    assert!(
        t.starts_with("rprof: process ") && t.ends_with(" - speedscope"),
        "speedscope did not import it: title {t:?}; console: {console:#?}; {stderr}"
    );
    assert!(
        console
            .iter()
            .any(|l| l.contains("Importing as speedscope json file")),
        "{console:#?}"
    );
    assert!(errors(&console).is_empty(), "console: {console:#?}");
    screenshot(&url, "speedscope.png");
}

/// Serves the files of `dir` over HTTP on a free local port (GET only),
/// from a thread, for as long as the test runs; the port.
fn serve(dir: PathBuf) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a local port");
    let port = listener.local_addr().expect("its address").port();
    std::thread::spawn(move || {
        for stream in listener.incoming().map_while(Result::ok) {
            answer(stream, &dir);
        }
    });
    port
}

/// One request: the file asked for, or 404.
fn answer(mut stream: TcpStream, dir: &Path) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone the stream"));
    let mut request = String::new();
    if reader.read_line(&mut request).is_err() {
        return;
    }
    // The headers, to their empty line.
    let mut line = String::new();
    while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
        line.clear();
    }
    let target = request.split_whitespace().nth(1).unwrap_or("/");
    let name = target
        .split(['?', '#'])
        .next()
        .unwrap_or("")
        .trim_start_matches('/');
    let file = (!name.contains("..")).then(|| dir.join(name));
    let response = match file.and_then(|f| std::fs::read(&f).ok().map(|b| (f, b))) {
        Some((f, body)) => {
            let kind = match f.extension().and_then(|e| e.to_str()).unwrap_or("") {
                "html" => "text/html; charset=utf-8",
                "js" => "text/javascript",
                "css" => "text/css",
                "json" => "application/json",
                "wasm" => "application/wasm",
                "png" => "image/png",
                "woff2" => "font/woff2",
                _ => "application/octet-stream",
            };
            let mut r = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )
            .into_bytes();
            r.extend(body);
            r
        }
        None => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec(),
    };
    let _ = stream.write_all(&response);
}
