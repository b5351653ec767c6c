//! What each pushed profile is labelled with: the service it is of (as the
//! process says in its environment, else its directory or command), the
//! host, the PID, its container; and the user's `--label`s. Nothing else
//! of the process's environment or arguments leaves the host.

use crate::error::UserError;

/// Environment variables naming a service, in order of preference (the
/// `pyroscope` gem's, then OpenTelemetry's).
const SERVICE_VARIABLES: [&str; 2] = ["PYROSCOPE_APPLICATION_NAME", "OTEL_SERVICE_NAME"];

/// A label name Pyroscope 1.x accepts (2.x accepts any): `[A-Za-z_][A-Za-z0-9_]*`,
/// not one of its own (`__name__`...).
pub fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with("__")
}

/// `--label NAME=VALUE`.
pub fn user_label(given: &str) -> Result<(String, String), UserError> {
    let bad = || UserError::BadLabel {
        given: given.to_string(),
    };
    let (name, value) = given.split_once('=').ok_or_else(bad)?;
    if !valid_name(name) || value.is_empty() || value.len() > 2048 {
        return Err(bad());
    }
    Ok((name.to_string(), value.to_string()))
}

/// This host's name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".to_string())
}

/// The labels of process `pid` (`command`: its command line):
/// `service_name`, `pid`, and `container_id`/`pod_uid` when its cgroup
/// says.
pub fn of_process(pid: u32, command: &str) -> Vec<(String, String)> {
    // The program's name only: arguments stay on the host.
    let program = command.split_whitespace().next().unwrap_or("");
    let comm = program.rsplit('/').next().unwrap_or(program);
    let mut labels = vec![
        ("service_name".to_string(), service_name(pid, comm)),
        ("pid".to_string(), pid.to_string()),
    ];
    if let Ok(cgroup) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) {
        if let Some(id) = container_id(&cgroup) {
            labels.push(("container_id".to_string(), id));
        }
        if let Some(uid) = pod_uid(&cgroup) {
            labels.push(("pod_uid".to_string(), uid));
        }
    }
    labels
}

/// `--only`/`--exclude`: whether the Ruby in process `pid` is profiled.
/// A pattern is a service name, or `cgroup:TEXT` for a cgroup path holding
/// TEXT.
pub fn admitted(pid: u32, only: &[String], exclude: &[String]) -> bool {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    let name = service_name(pid, comm.trim());
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let matches = |pattern: &String| match pattern.strip_prefix("cgroup:") {
        Some(text) => cgroup.contains(text),
        None => *pattern == name,
    };
    (only.is_empty() || only.iter().any(matches)) && !exclude.iter().any(matches)
}

/// From the process's environment, else its working directory's name (an
/// app's checkout: `/srv/shop/current` is `shop`), else its command.
fn service_name(pid: u32, comm: &str) -> String {
    if let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) {
        for var in SERVICE_VARIABLES {
            let prefix = format!("{var}=");
            let value = env
                .split(|&b| b == 0)
                .find_map(|kv| kv.strip_prefix(prefix.as_bytes()))
                .map(|v| String::from_utf8_lossy(v).into_owned());
            if let Some(v) = value.filter(|v| !v.is_empty()) {
                return v;
            }
        }
    }
    let dir = std::fs::read_link(format!("/proc/{pid}/cwd")).ok();
    let named = dir.as_deref().and_then(|d| {
        let mut parts = d.iter().rev().filter_map(|p| p.to_str());
        let last = parts.next()?;
        // Capistrano's `current` and `releases/TIMESTAMP` are not names.
        let name = if last == "current" || last.chars().all(|c| c.is_ascii_digit()) {
            parts.find(|p| *p != "releases")?
        } else {
            last
        };
        (name != "/" && !name.is_empty()).then(|| name.to_string())
    });
    named.unwrap_or_else(|| comm.to_string())
}

/// A container's ID in a cgroup path: the 64 hex digits of Docker's
/// (`docker-ID.scope`, `/docker/ID`), containerd's (`cri-containerd-ID`) or
/// CRI-O's (`crio-ID`).
pub fn container_id(cgroup: &str) -> Option<String> {
    cgroup.lines().find_map(|line| {
        let path = line.rsplit(':').next()?;
        path.split(['/', '-', '.'])
            .find(|w| w.len() == 64 && w.chars().all(|c| c.is_ascii_hexdigit()))
            .map(str::to_string)
    })
}

/// A Kubernetes pod's UID in a cgroup path (`kubepods-burstable-podUID.slice`,
/// with `_` for `-`, or `/kubepods/burstable/podUID/`).
pub fn pod_uid(cgroup: &str) -> Option<String> {
    cgroup.lines().find_map(|line| {
        line.match_indices("pod").find_map(|(at, _)| {
            let uid: String = line[at + 3..]
                .chars()
                .take_while(|c| c.is_ascii_hexdigit() || *c == '-' || *c == '_')
                .map(|c| if c == '_' { '-' } else { c })
                .collect();
            (uid.len() == 36).then_some(uid)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_and_pod_from_cgroup_paths() {
        let id = "4c1f9b6f0c5a1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3";
        assert_eq!(
            container_id(&format!("0::/system.slice/docker-{id}.scope\n")),
            Some(id.to_string())
        );
        assert_eq!(
            container_id(&format!("12:cpu:/docker/{id}\n")),
            Some(id.to_string())
        );
        let k8s = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_5f60_7182_93a4_b5c6d7e8f901.slice/cri-containerd-{id}.scope\n"
        );
        assert_eq!(container_id(&k8s), Some(id.to_string()));
        assert_eq!(
            pod_uid(&k8s).as_deref(),
            Some("1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901")
        );
        assert_eq!(
            container_id("0::/user.slice/user-0.slice/session-3.scope\n"),
            None
        );
        assert_eq!(pod_uid("0::/user.slice/user-0.slice/session-3.scope\n"), None);
    }

    #[test]
    fn label_names_pyroscope_accepts() {
        assert!(valid_name("env") && valid_name("thread_name") && valid_name("_x1"));
        assert!(!valid_name("thread name") && !valid_name("1x") && !valid_name("a-b") && !valid_name(""));
        assert!(!valid_name("__name__"));
        assert!(user_label("env=prod").is_ok());
        assert!(user_label("env").is_err() && user_label("e v=1").is_err() && user_label("env=").is_err());
    }
}
