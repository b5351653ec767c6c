//! A layout is proven on the live process before the first sample, and a
//! layout that does not fit is refused with one line, never used: each
//! group of offsets shifted by 8 bytes in turn (RPROF_LAYOUT_FILE), and
//! another minor version's layout forced with --force-version.

use crate::common;

use common::{record_args, record_with_env, Ruby};

/// The offsets of each layout group (not its sizes, masks or type numbers),
/// as `ruby-structs/layouts/X.Y.toml` names them.
const GROUPS: &[(&str, &[&str])] = &[
    (
        "execution_context",
        &["vm_stack", "vm_stack_size", "cfp", "thread_ptr"],
    ),
    (
        "thread",
        &[
            "ec",
            "native_thread",
            "native_thread_id",
            "vm_living_threads",
            "living_threads_node",
            "name",
            "dedicated_nt_byte",
        ],
    ),
    ("control_frame", &["pc", "sp", "iseq", "self", "ep", "jit_return"]),
    (
        "iseq",
        &[
            "body",
            "type",
            "iseq_size",
            "iseq_encoded",
            "pathobj",
            "base_label",
            "label",
            "first_lineno",
            "insns_info_body",
            "insns_info_size",
            "succ_index_table",
            "local_iseq",
            "parent_iseq",
            "insn_info_line_no",
        ],
    ),
    (
        "method_entry",
        &[
            "flags",
            "defined_class",
            "def",
            "called_id",
            "owner",
            "def_original_id",
            "def_body",
        ],
    ),
    ("string", &["len", "heap_ptr", "embed_ary"]),
    ("array", &["len", "heap_ptr", "embed_ary"]),
    (
        "class",
        &[
            "ext_ptr",
            "ext_iv_tbl",
            "ext_embedded",
            "ext_classpath",
            "ext_attached_object",
            "ext_permanent_classpath_byte",
        ],
    ),
    (
        "st_table",
        &[
            "entries_start",
            "entries_bound",
            "entries",
            "entry_hash",
            "entry_key",
            "entry_record",
        ],
    ),
    // rprof finds a hidden symbol table (Debian's 3.1+) by the address its
    // code uses for `last_id`: shifting both is the same table, read right.
    ("symbols", &["ids"]),
    ("gc", &["major_gc_count_from_count", "minor_gc_count_from_count"]),
];

/// `text` with the offsets of `group` moved by 8 bytes; None if the layout
/// has none of them (a Ruby that keeps no class ivars in an st_table).
fn shifted(text: &str, group: &str, fields: &[&str]) -> Option<String> {
    let mut section = String::new();
    let mut moved = 0;
    let lines: Vec<String> = text
        .lines()
        .map(|line| {
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name.to_string();
            }
            let Some((key, value)) = line.split_once(" = ") else {
                return line.to_string();
            };
            match value.parse::<i64>() {
                Ok(v) if section == group && fields.contains(&key) => {
                    moved += 1;
                    format!("{key} = {}", v + 8)
                }
                _ => line.to_string(),
            }
        })
        .collect();
    (moved > 0).then(|| lines.join("\n") + "\n")
}

/// The minor version whose layout the Ruby named `name` uses.
fn minor_of(name: &str) -> &str {
    &name[..3]
}

/// Whether rprof's layout for this Ruby reads a group at all: the st_table
/// only holds class names before 3.2.
fn read_at_all(minor: &str, group: &str) -> bool {
    group != "st_table" || minor < "3.2"
}

/// Records `pid` for a second with `env`: the run must be refused, with one
/// line naming the Ruby, the check and what to do, and write nothing.
fn assert_refused(pid: u32, args: &[&str], env: &[(&str, &str)], what: &str) {
    let run = record_with_env(pid, args, env);
    assert!(
        !run.success,
        "{what}: recorded with a wrong layout: {}",
        run.stderr
    );
    assert!(!run.stderr.contains("panicked"), "{what}: {}", run.stderr);
    let refusals: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.starts_with("rprof: error: ") && l.contains("layout does not fit"))
        .collect();
    assert_eq!(refusals.len(), 1, "{what}: want one refusal: {}", run.stderr);
    let line = refusals[0];
    assert!(
        line.contains(&format!("process {pid} runs ruby ")),
        "{what}: {line}"
    );
    assert!(line.contains("--force-version X.Y"), "{what}: {line}");
    assert!(
        !run.stderr.contains("rprof: recording"),
        "{what}: refused only after recording began: {}",
        run.stderr
    );
    assert_eq!(run.folded.total(), 0, "{what}: {:?}", run.folded.stacks);
}

fn check_proof(name: &str) {
    let r = Ruby::named(name);
    let target = r.spawn("ratio.rb", &[]);
    let minor = minor_of(name);
    let text = common::layout_text(minor);
    // The file itself is proven and used.
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("layout.toml");
    std::fs::write(&file, &text).expect("write layout");
    let env = [("RPROF_LAYOUT_FILE", file.to_str().expect("utf8"))];
    let run = record_with_env(target.pid, &["-d", "1"], &env);
    assert!(run.success, "Ruby {name}: its own layout: {}", run.stderr);
    assert!(
        run.folded.count(|f| f.contains("thrice (")) > 0,
        "{:?}",
        run.folded.stacks
    );
    for (group, fields) in GROUPS.iter().filter(|(g, _)| read_at_all(minor, g)) {
        let Some(wrong) = shifted(&text, group, fields) else {
            continue;
        };
        std::fs::write(&file, wrong).expect("write layout");
        assert_refused(
            target.pid,
            &["-d", "1"],
            &env,
            &format!("Ruby {name}, [{group}] + 8"),
        );
    }
}

macro_rules! on_every_ruby {
    ($($version:ident => $name:literal),*) => {
        $(
            mod $version {
                #[test] fn a_wrong_layout_is_refused() { super::check_proof($name) }
            }
        )*
    };
}

on_every_ruby!(ruby_2_7 => "2.7", ruby_3_1 => "3.1", ruby_3_1_static => "3.1-static", ruby_3_3 => "3.3",
               ruby_3_4 => "3.4", ruby_3_3_yjit => "3.3-yjit", ruby_3_3_fp => "3.3-fp");

/// Another minor version's layout, forced, is proven wrong too.
#[test]
fn another_versions_layout_forced_is_refused() {
    for (name, forced) in [
        ("2.7", "3.1"),
        ("3.1", "2.7"),
        ("3.1", "3.3"),
        ("3.1", "3.4"),
        ("3.3", "3.4"),
        ("3.4", "3.3"),
        ("3.4", "3.1"),
        // 3.2 and 4.0, which no machine here runs, are wrong for these.
        ("3.1", "3.2"),
        ("3.3", "3.2"),
        ("3.3", "4.0"),
        ("3.4", "4.0"),
    ] {
        let target = Ruby::named(name).spawn("ratio.rb", &[]);
        assert_refused(
            target.pid,
            &["-d", "1", "--force-version", forced],
            &[],
            &format!("Ruby {name} read as {forced}"),
        );
    }
}

/// Under --subprocesses, a process whose Ruby does not fit is counted and
/// named in the summary, and the others are profiled. (A followed Ruby is
/// refused once its proof has failed for 2 s, which a Ruby still booting
/// may: well within the 4 s recorded.)
#[test]
fn a_child_that_does_not_fit_is_named_and_the_rest_go_on() {
    // The host's 3.1 starts a 3.3 (in its chroot); the recording forces the
    // 3.1 layout on both.
    let other = Ruby::named("3.3");
    let root = other.root.clone().expect("3.3 runs in a chroot");
    // The child only has to be there: it sleeps, and ends with its parent.
    let child = "parent = Process.ppid; loop { sleep 0.05; exit if Process.ppid != parent }";
    let target = Ruby::host().spawn(
        "two_rubies.rb",
        &["chroot", root.to_str().expect("utf8"), &other.exe, "-e", child],
    );
    let pid = target.pid.to_string();
    let run = record_args(&[
        "-p",
        &pid,
        "--subprocesses",
        "--force-version",
        "3.1",
        "-F",
        "499",
        "-d",
        "4",
    ]);
    assert!(run.success, "{}", run.stderr);
    assert!(
        run.stderr
            .contains("1 refused (their Ruby does not fit rprof's layout)"),
        "{}",
        run.stderr
    );
    let named: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.starts_with("rprof: not profiled: process ") && l.contains("runs ruby 3.3."))
        .collect();
    assert_eq!(named.len(), 1, "{}", run.stderr);
    assert!(
        run.folded.count(|f| f.contains("spin (")) > 100,
        "{:?}",
        run.folded.stacks
    );
}

#[test]
fn a_layout_file_that_does_not_parse_is_one_line() {
    let target = Ruby::host().spawn("ratio.rb", &[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("broken.toml");
    std::fs::write(&file, "version = 3.1\n").expect("write");
    let out = std::process::Command::new(common::RPROF)
        .args(["record", "-p", &target.pid.to_string(), "-d", "1"])
        .env("RPROF_LAYOUT_FILE", &file)
        .output()
        .expect("run rprof");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("broken.toml"), "{stderr}");
}
