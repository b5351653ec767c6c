//! What installing rprof on a server relies on: a version that names its
//! commit, and man pages and shell completions made from the command line's
//! own definition (for packages).

mod common;

use std::process::Command;

use common::rprof;

#[test]
fn version_names_the_commit_it_was_built_from() {
    let out = rprof(&["--version"]);
    assert!(out.status.success());
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("git");
    let head = String::from_utf8_lossy(&head.stdout).trim().to_string();
    assert_eq!(head.len(), 12, "built from a git checkout");
    assert!(
        version.starts_with(&format!("rprof {} (commit {head}", env!("CARGO_PKG_VERSION"))),
        "{version}"
    );
}

#[test]
fn man_pages_and_completions_come_from_the_command_line_itself() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = rprof(&["generate", "man", dir.path().to_str().expect("utf8")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for page in ["rprof.1", "rprof-record.1", "rprof-report.1"] {
        let shown = Command::new("man")
            .arg("-l")
            .arg(dir.path().join(page))
            .env("MANWIDTH", "100")
            .output()
            .expect("man (man-db)");
        let text = without_overstrike(&String::from_utf8_lossy(&shown.stdout));
        assert!(shown.status.success() && text.contains("NAME"), "{page}: {text}");
        if page == "rprof-record.1" {
            assert!(text.contains("--flight-recorder"), "{text}");
        }
    }
    for shell in ["bash", "zsh", "fish"] {
        let out = rprof(&["generate", "completions", shell]);
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && script.contains("flight-recorder"),
            "{shell}: {script}"
        );
    }
    let help = rprof(&["--help"]);
    assert!(
        !String::from_utf8_lossy(&help.stdout).contains("generate"),
        "hidden from --help"
    );
}

/// man's bold and underline as a terminal shows them: `N\x08N` is `N`.
fn without_overstrike(text: &str) -> String {
    let mut out: Vec<char> = Vec::with_capacity(text.len());
    for c in text.chars() {
        if c == '\u{8}' {
            out.pop();
        } else {
            out.push(c);
        }
    }
    out.into_iter().collect()
}
