//! `rprof agent`: every Ruby process on the host, recorded without end
//! (`record --all`), one profile per process per interval pushed to Grafana
//! Pyroscope. The recording is `record`'s own; the agent adds a sink
//! (`sink.rs`: epochs into per-process profiles), the labels it gives them
//! (`labels.rs`) and a sender on its own thread (`push.rs`), so that a slow
//! or absent server never slows the recording.

mod labels;
mod push;
mod sink;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::cli::{self, AgentArgs, AgentEvent};
use crate::error::UserError;
use crate::record::{self, EventSpec, RecordConfig, Target};
use crate::recording::RenderOptions;

/// Runs the agent until a stop signal (or `--duration`).
pub fn run(args: AgentArgs) -> Result<()> {
    let interval = cli::parse_duration(&args.interval)?;
    if interval < Duration::from_secs(1) {
        anyhow::bail!("--interval must be at least 1s, not {}", args.interval);
    }
    let endpoint = push::Endpoint {
        url: push_url(&args.push)?,
        basic_auth: match (&args.basic_auth_user, &args.basic_auth_password_file) {
            (Some(user), Some(file)) => Some((user.clone(), password(file)?)),
            _ => None,
        },
        tenant: args.tenant.clone(),
    };
    let labels = args
        .labels
        .iter()
        .map(|l| labels::user_label(l))
        .collect::<Result<Vec<_>, _>>()?;
    let duration = match args.duration {
        Some(d) if !(d > 0.0 && d.is_finite()) => {
            anyhow::bail!("-d/--duration must be a positive number of seconds")
        }
        d => d.map(Duration::from_secs_f64),
    };
    let (event, name) = match args.event {
        AgentEvent::Cpu => (
            EventSpec::Cpu {
                frequency: args.frequency,
            },
            "process_cpu",
        ),
        AgentEvent::Wall => (
            EventSpec::Wall {
                frequency: args.frequency,
            },
            "wall",
        ),
    };
    eprintln!(
        "rprof: agent pushing every {} to {}",
        humantime::format_duration(interval),
        endpoint.url
    );
    let sender = push::Sender::start(endpoint)?;
    let unit = event.recorded().unit();
    let sink = sink::Pusher::new(interval, name, unit, labels, sender);
    record::record(RecordConfig {
        target: Target::All,
        duration,
        event,
        output: None,
        format: None,
        raw: None,
        continuous: None,
        quiet: true,
        force_version: None,
        as_root: false,
        subprocesses: true,
        render: RenderOptions::default(),
        native: false,
        native_all: false,
        kernel: false,
        top: false,
        sink: Some(Box::new(sink)),
        admit: (!args.only.is_empty() || !args.exclude.is_empty()).then(|| {
            let (only, exclude) = (args.only.clone(), args.exclude.clone());
            Box::new(move |pid| labels::admitted(pid, &only, &exclude)) as crate::processes::Admit
        }),
    })?;
    Ok(())
}

/// Where pushes go: the server's URL, its path kept (a proxy's prefix).
fn push_url(given: &str) -> Result<String, UserError> {
    if !(given.starts_with("http://") || given.starts_with("https://")) {
        return Err(UserError::BadPushUrl {
            given: given.to_string(),
        });
    }
    Ok(format!(
        "{}/push.v1.PusherService/Push",
        given.trim_end_matches('/')
    ))
}

/// The basic-auth password, from a file only its owner may read.
fn password(file: &Path) -> Result<String> {
    let meta = std::fs::metadata(file).with_context(|| format!("reading {}", file.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(UserError::OpenPasswordFile {
            path: file.display().to_string(),
            mode,
        }
        .into());
    }
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    Ok(text.trim_end_matches(['\n', '\r']).to_string())
}
