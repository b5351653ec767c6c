//! rprof: parses the command line, runs it, prints errors. Nothing else.

mod address_space;
mod agent;
mod bpf;
mod cli;
mod disasm;
mod elf;
mod error;
mod gc_time;
mod heap_log;
mod launch;
mod pace;
mod process;
mod processes;
mod proof;
mod record;
mod recording;
mod resolve;
mod system;
mod target;
mod unwind;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::Parser;

use cli::{Cli, Command, Event, ReportArgs};
use record::{Continuous, EventSpec, RecordConfig, Target};
use recording::report::ReportConfig;
use recording::RenderOptions;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(err) => {
            // A problem the user can fix is one line; anything else gets its whole cause chain.
            match err.chain().find_map(|e| e.downcast_ref::<error::UserError>()) {
                Some(user) => eprintln!("rprof: error: {user}"),
                None => eprintln!("rprof: error: {err:#}"),
            }
            ExitCode::FAILURE
        }
    }
}

/// Runs the command; a launched command's exit status becomes rprof's.
fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Record(args) => {
            let Some(cfg) = record_config(args)? else {
                return Ok(ExitCode::SUCCESS);
            };
            let status = record::record(cfg)?;
            Ok(status.map_or(ExitCode::SUCCESS, |s| ExitCode::from(launch::exit_code(s))))
        }
        Command::Top(args) => {
            let Some(mut cfg) = record_config(args)? else {
                return Ok(ExitCode::SUCCESS);
            };
            if cfg.continuous.is_some() || cfg.raw.is_some() {
                anyhow::bail!("rprof top shows what runs now: --rotate, --flight-recorder and --raw belong to rprof record");
            }
            cfg.top = true;
            let status = record::record(cfg)?;
            Ok(status.map_or(ExitCode::SUCCESS, |s| ExitCode::from(launch::exit_code(s))))
        }
        Command::Agent(args) => {
            agent::run(args)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Report(args) => {
            report(args)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Diff(args) => {
            recording::report::report(ReportConfig {
                input: args.after,
                output: args.output,
                format: args.format,
                from: None,
                to: None,
                pids: Vec::new(),
                threads: Vec::new(),
                render: RenderOptions {
                    by_line: args.compare.by_line,
                    ..RenderOptions::default()
                },
                diff: Some(args.before),
                absolute: args.compare.absolute,
                open: false,
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Generate { what } => {
            generate(what)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// How long `alloc` records a running program when no -d is given.
const ALLOC_DEFAULT_DURATION: Duration = Duration::from_secs(10);

/// `rprof record`'s (and `top`'s) arguments, checked; None once
/// `syscall --list` has listed.
fn record_config(args: cli::RecordArgs) -> Result<Option<RecordConfig>> {
    let (event, extra_command) = match args.event {
        None => (
            EventSpec::Cpu {
                frequency: args.frequency,
            },
            Vec::new(),
        ),
        Some(Event::Cpu { command }) => (
            EventSpec::Cpu {
                frequency: args.frequency,
            },
            command,
        ),
        Some(Event::Wall { command }) => (
            EventSpec::Wall {
                frequency: args.frequency,
            },
            command,
        ),
        Some(Event::Alloc { every, command }) => {
            if args.native || args.kernel {
                return Err(error::UserError::AllocWithNative.into());
            }
            (EventSpec::Alloc { every }, command)
        }
        Some(Event::Syscall { names, list, command }) => {
            let known = system::syscall_tracepoints()?;
            if list {
                for name in known {
                    println!("{name}");
                }
                return Ok(None);
            }
            let tracepoints = names
                .iter()
                .map(|n| system::syscall_tracepoint(n, &known))
                .collect::<Result<Vec<_>, _>>()?;
            (EventSpec::Syscalls(tracepoints), command)
        }
    };
    let mut command = args.command;
    command.extend(extra_command);
    let target = match (args.pid.is_empty(), command.is_empty()) {
        (_, false) if args.all => anyhow::bail!("give either --all or a command after --, not both"),
        (_, true) if args.all => Target::All,
        (false, true) => Target::Pids(args.pid),
        (true, false) => Target::Command(command),
        (false, false) => anyhow::bail!("give either -p PID or a command after --, not both"),
        (true, true) => {
            anyhow::bail!("nothing to profile: give -p PID or a command after -- (see rprof record --help)")
        }
    };
    let duration = match args.duration {
        Some(d) if !(d > 0.0 && d.is_finite()) => {
            anyhow::bail!("-d/--duration must be a positive number of seconds")
        }
        Some(d) => Some(Duration::from_secs_f64(d)),
        None => None,
    };
    let continuous = match (&args.rotate, &args.flight_recorder) {
        (Some(every), _) => Some(Continuous::Rotate {
            every: positive(cli::parse_duration(every)?, "--rotate")?,
            keep: args.keep,
        }),
        (None, Some(window)) => Some(Continuous::FlightRecorder {
            window: positive(cli::parse_duration(window)?, "--flight-recorder")?,
        }),
        (None, None) => None,
    };
    // Every allocation traps while `alloc` records (microseconds each): on
    // a running program it stops by itself unless told how long.
    let duration = match (&event, &target, &continuous) {
        (EventSpec::Alloc { .. }, Target::Pids(_) | Target::All, None) if duration.is_none() => {
            Some(ALLOC_DEFAULT_DURATION)
        }
        _ => duration,
    };
    if args.keep == Some(0) {
        anyhow::bail!("--keep 0 would keep nothing: give at least 1");
    }
    Ok(Some(RecordConfig {
        target,
        duration,
        event,
        output: args.output,
        format: args.format,
        raw: args.raw,
        continuous,
        quiet: args.quiet,
        force_version: args.force_version,
        as_root: args.root,
        subprocesses: args.subprocesses || args.all,
        render: RenderOptions {
            processes: args.processes,
            threads: args.threads,
            by_line: args.by_line,
        },
        native: args.native || args.native_all,
        native_all: args.native_all,
        kernel: args.kernel,
        top: false,
        sink: None,
        admit: None,
    }))
}

/// Man pages and completions, from the command line's own definition.
fn generate(what: cli::Generate) -> Result<()> {
    use anyhow::Context;
    use clap::CommandFactory;
    let mut cmd = Cli::command();
    match what {
        cli::Generate::Man { dir } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            clap_mangen::generate_to(cmd, &dir)
                .with_context(|| format!("writing man pages into {}", dir.display()))
        }
        cli::Generate::Completions { shell } => {
            clap_complete::generate(shell, &mut cmd, "rprof", &mut std::io::stdout());
            Ok(())
        }
    }
}

fn positive(d: Duration, what: &str) -> Result<Duration> {
    if d.is_zero() {
        anyhow::bail!("{what} must be longer than 0 seconds");
    }
    Ok(d)
}

/// `rprof report`'s arguments, checked.
fn report(args: ReportArgs) -> Result<()> {
    let duration = |t: &Option<String>| t.as_deref().map(cli::parse_duration).transpose();
    recording::report::report(ReportConfig {
        from: duration(&args.from)?,
        to: duration(&args.to)?,
        input: args.input,
        output: args.output,
        format: args.format,
        pids: args.pid,
        threads: args.thread,
        render: RenderOptions {
            processes: args.processes,
            threads: args.threads,
            by_line: args.by_line,
        },
        diff: args.diff,
        absolute: args.absolute,
        open: args.open,
    })
}
