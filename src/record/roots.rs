//! The processes a recording starts from: PIDs given with -p, or a command
//! rprof starts and waits for until its Ruby can be read.

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::{RecordConfig, Target};
use crate::bpf::{Probe, ThreadLister};
use crate::error::UserError;
use crate::launch::{self, StopSignals};
use crate::process::Process;
use crate::processes::{self, ProcessId, Processes};
use crate::proof;
use crate::target::RubyTarget;

/// `PID (exe, Ruby X.Y.Z)`, as the first line names a target.
pub fn describe(t: &RubyTarget) -> String {
    format!("{} ({}, Ruby {})", t.process.pid, t.process.exe_name(), t.version)
}

/// The processes given with -p, inspected, and those that are Rubies
/// proven, before rprof's BPF programs load (`Processes::prove_root`): a
/// Ruby rprof cannot read is refused before the kernel verifies them.
pub struct Given(Vec<(u32, Result<RubyTarget>)>);

/// Inspects and proves the processes given with -p; the first that cannot
/// be profiled ends rprof here, before its programs load.
pub fn inspect_given(cfg: &RecordConfig, threads: &ThreadLister, processes: &mut Processes) -> Result<Given> {
    let Target::Pids(pids) = &cfg.target else {
        return Ok(Given(Vec::new()));
    };
    let mut given = Vec::new();
    for &pid in pids {
        let target = match RubyTarget::inspect(pid, cfg.force_version.as_deref()) {
            Ok(t) => {
                processes.prove_root(threads, &t, proof::ATTEMPTS_FOR)?;
                Ok(t)
            }
            // Under --subprocesses its Ruby children are followed.
            Err(e)
                if cfg.subprocesses
                    && matches!(e.downcast_ref::<UserError>(), Some(UserError::NotRuby { .. })) =>
            {
                Err(e)
            }
            Err(e) => return Err(e),
        };
        given.push((pid, target));
    }
    Ok(Given(given))
}

/// Starts profiling process `pid` given with -p (`target`, as inspected).
/// Under --subprocesses a process that is not a Ruby rprof can read (a
/// shell, a supervisor) is followed, and its Ruby children are profiled.
fn add_root(
    probe: &mut Probe,
    processes: &mut Processes,
    (pid, target): (u32, Result<RubyTarget>),
    cfg: &RecordConfig,
) -> Result<String> {
    match target {
        Ok(t) => {
            let name = describe(&t);
            processes.add_root(probe, t, cfg.subprocesses, proof::ATTEMPTS_FOR)?;
            Ok(name)
        }
        Err(e)
            if cfg.subprocesses
                && matches!(e.downcast_ref::<UserError>(), Some(UserError::NotRuby { .. })) =>
        {
            let process = Process::open(pid)?;
            let start_ticks = process.start_ticks().ok_or(UserError::NoSuchProcess { pid })?;
            processes.add_followed_root(probe, ProcessId { pid, start_ticks })?;
            Ok(format!(
                "{pid} ({}, not Ruby: its children are followed)",
                process.exe_name()
            ))
        }
        Err(e) => Err(e),
    }
}

pub fn cfg_command_name(t: &Target) -> String {
    match t {
        Target::Command(argv) => argv.join(" "),
        Target::Pids(pids) => pids.iter().map(u32::to_string).collect::<Vec<_>>().join(", "),
        Target::All => "every Ruby process".to_string(),
    }
}

/// --all: every Ruby process running now, each a root whose forks are
/// followed (those started later are found as they exec). One that cannot
/// be profiled is counted and named in the summary, never the end of the
/// recording. Returns how the first line names each.
fn add_every_ruby(probe: &mut Probe, processes: &mut Processes, cfg: &RecordConfig) -> Vec<String> {
    let me = std::process::id();
    let mut roots = Vec::new();
    for pid in crate::process::all_pids().into_iter().filter(|&p| p != me) {
        let Ok(t) = RubyTarget::inspect(pid, cfg.force_version.as_deref()) else {
            continue; // not a Ruby, or gone
        };
        if !processes.admits(pid) {
            continue;
        }
        if !t.ready() {
            // Still booting: looked at until its VM is up (or let go).
            let id = ProcessId {
                pid,
                start_ticks: t.start_ticks,
            };
            if let Err(e) = processes.add_followed_root(probe, id) {
                processes.note_refused(format!("{pid}: {e:#}"));
            }
            continue;
        }
        let name = describe(&t);
        match processes.add_root(probe, t, true, proof::ATTEMPTS_FOR) {
            Ok(()) => roots.push(name),
            Err(e) => processes.note_refused(format!("{e:#}")),
        }
    }
    roots
}

/// Starts the command and waits until its Ruby VM can be read.
pub fn launch(argv: &[String], cfg: &RecordConfig, signals: &StopSignals) -> Result<(Child, RubyTarget)> {
    let mut child = launch::spawn(argv, cfg.as_root)?;
    let pid = child.id();
    signals.forward_to(pid);
    let prog = &argv[0];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match RubyTarget::inspect(pid, cfg.force_version.as_deref()) {
            Ok(t) if t.ready() => return Ok((child, t)),
            Ok(_) => {}
            Err(e) => {
                let user = e.downcast_ref::<UserError>();
                if matches!(user, Some(UserError::UnsupportedVersion(_))) || Instant::now() > deadline {
                    let _ = child.kill();
                    return Err(e);
                }
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(anyhow::Error::from(UserError::TargetGone { pid }))
                .with_context(|| format!("{prog} exited with {status}"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Starts profiling what the command line names: the processes given, or
/// the command, started. Returns the command's child, and how the first
/// line names each root.
pub fn start(
    cfg: &RecordConfig,
    given: Given,
    probe: &mut Probe,
    processes: &mut Processes,
    signals: &StopSignals,
) -> Result<(Option<Child>, Vec<String>)> {
    let mut child = None;
    let mut roots = Vec::new();
    match &cfg.target {
        Target::All => roots = add_every_ruby(probe, processes, cfg),
        Target::Pids(pids) => {
            for pid_target in given.0 {
                roots.push(add_root(probe, processes, pid_target, cfg)?);
            }
            if cfg.subprocesses {
                for &pid in pids {
                    processes.adopt_descendants(probe, pid)?;
                }
            }
        }
        Target::Command(argv) if cfg.subprocesses => {
            // Follow rprof's own forks while it starts the command, so the
            // command is followed from its first instruction.
            let me = Process::open(std::process::id())?;
            let my_start = me.start_ticks().context("reading rprof's own start time")?;
            probe.follow(me.pid, my_start)?;
            let c = launch::spawn(argv, cfg.as_root)?;
            signals.forward_to(c.id());
            probe.unfollow(me.pid);
            roots.push(format!("{} (pid {})", argv.join(" "), c.id()));
            child = Some(c);
        }
        Target::Command(argv) => {
            let (mut c, t) = launch(argv, cfg, signals)?;
            roots.push(describe(&t));
            // Its VM is still booting: the proof waits for its main thread.
            if let Err(e) = processes.add_root(probe, t, false, processes::BOOT_PROOF) {
                let _ = c.kill();
                return Err(e);
            }
            child = Some(c);
        }
    }
    Ok((child, roots))
}

/// The exit status of the command rprof started, once it has ended: waited
/// for if it got the stop signal too (as a shell would), else said to run on.
pub fn command_exit(
    child: Option<Child>,
    signals: &StopSignals,
    target: &Target,
    pid: u32,
) -> Result<Option<ExitStatus>> {
    let Some(mut c) = child else { return Ok(None) };
    if let Ok(Some(status)) = c.try_wait() {
        return Ok(Some(status));
    }
    if signals.stopped() {
        // The command got the signal too: wait for it as a shell would.
        return c.wait().map(Some).context("waiting for the command to exit");
    }
    eprintln!(
        "rprof: {} (pid {}) is still running",
        cfg_command_name(target),
        pid
    );
    Ok(None)
}
