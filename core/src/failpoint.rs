//! Failpoints: named places in the paths that fail in production (disk I/O, transfer
//! connections, master answers, etcd leases, memory registration) where a test can make
//! the failure happen on purpose.
//!
//! Only a build with the `failpoints` feature of `mooncake-core` evaluates them; in any
//! other build [`hit`] is an inlined `None` and costs nothing. In a failpoints build a
//! failpoint is off until configured:
//!
//! * at startup from `FAILPOINTS`, `name=actions` entries separated by `;`;
//! * while running from the file `MOONCAKE_FAILPOINTS_FILE` names (same syntax, one or
//!   more entries per line), read again whenever it changes (checked every 100 ms);
//!   a failpoint the file no longer names is switched off;
//! * in-process with [`configure`] and [`clear`].
//!
//! `actions` is a chain of `[P%][N*]kind[(arg)]` joined by `->`: `kind` is `off`,
//! `return` (the place fails; `arg` says how, e.g. `eio`, `enospc`, `short`) or
//! `sleep` (`arg` in milliseconds, then go on). `N*` limits an action to its first `N`
//! evaluations, after which the next action in the chain applies; `P%` makes it fire
//! with that probability. `3*off->1*return(eio)` lets three writes through, fails the
//! fourth and none after. Each place documents its name and the args it understands
//! (docs/troubleshooting.md lists them all).

/// Whether failpoint `name` fires now: `Some(arg)` (the `return` argument, empty when
/// none) when it does, `None` when it is off, or after a `sleep` action slept.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &str) -> Option<String> {
    None
}

/// Whether failpoint `name` fires now: `Some(arg)` (the `return` argument, empty when
/// none) when it does, `None` when it is off, or after a `sleep` action slept.
#[cfg(feature = "failpoints")]
pub fn hit(name: &str) -> Option<String> {
    registry::hit(name)
}

/// Whether this build evaluates failpoints (the `failpoints` feature).
pub const ENABLED: bool = cfg!(feature = "failpoints");

/// Sets failpoint `name` to `actions` in this process (failpoints builds only; an
/// error names what does not parse).
#[cfg(feature = "failpoints")]
pub fn configure(name: &str, actions: &str) -> Result<(), String> {
    registry::configure(name, actions)
}

/// Switches every failpoint of this process off.
#[cfg(feature = "failpoints")]
pub fn clear() {
    registry::clear();
}

#[cfg(feature = "failpoints")]
mod registry {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    use std::time::{Duration, SystemTime};

    /// What one link of a chain does when it applies.
    #[derive(Debug, Clone, PartialEq)]
    enum Kind {
        Off,
        Return(String),
        Sleep(Duration),
    }

    /// One link: its kind, how many evaluations it has left, its probability.
    #[derive(Debug, Clone, PartialEq)]
    struct Action {
        kind: Kind,
        remaining: Option<u64>,
        percent: u32,
    }

    #[derive(Default)]
    struct Registry {
        points: HashMap<String, Vec<Action>>,
        /// Names the watched file set (switched off when it stops naming them).
        from_file: Vec<String>,
        dice: u64,
    }

    fn registry() -> &'static Mutex<Registry> {
        static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
        REGISTRY.get_or_init(|| {
            let mut registry = Registry {
                dice: 0x9e37_79b9_7f4a_7c15,
                ..Registry::default()
            };
            if let Ok(spec) = std::env::var("FAILPOINTS") {
                for (name, actions) in entries(&spec) {
                    match parse(&actions) {
                        Ok(chain) => {
                            registry.points.insert(name, chain);
                        }
                        Err(error) => eprintln!("FAILPOINTS: {name}: {error}"),
                    }
                }
            }
            if let Some(path) = std::env::var_os("MOONCAKE_FAILPOINTS_FILE") {
                let path = std::path::PathBuf::from(path);
                // Read now, so that the first evaluation already sees the file.
                let seen = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
                if let Ok(text) = std::fs::read_to_string(&path) {
                    apply_entries(&mut registry, &text);
                    acknowledge(&path, &text);
                }
                let _ = std::thread::Builder::new()
                    .name("failpoints".into())
                    .spawn(move || watch(path, seen));
            }
            Mutex::new(registry)
        })
    }

    pub(super) fn hit(name: &str) -> Option<String> {
        let kind = {
            let mut registry = registry().lock().unwrap_or_else(|e| e.into_inner());
            registry.dice ^= registry.dice << 13;
            registry.dice ^= registry.dice >> 7;
            registry.dice ^= registry.dice << 17;
            let roll = u32::try_from(registry.dice % 100).unwrap_or(0);
            let chain = registry.points.get_mut(name)?;
            let action = chain.iter_mut().find(|a| a.remaining != Some(0))?;
            if let Some(left) = action.remaining.as_mut() {
                *left -= 1;
            }
            if roll >= action.percent {
                return None;
            }
            action.kind.clone()
        };
        match kind {
            Kind::Off => None,
            Kind::Return(arg) => {
                tracing::warn!(failpoint = name, arg, "failpoint fired");
                Some(arg)
            }
            Kind::Sleep(duration) => {
                std::thread::sleep(duration);
                None
            }
        }
    }

    pub(super) fn configure(name: &str, actions: &str) -> Result<(), String> {
        let chain = parse(actions)?;
        let mut registry = registry().lock().unwrap_or_else(|e| e.into_inner());
        registry.points.insert(name.to_string(), chain);
        Ok(())
    }

    pub(super) fn clear() {
        registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .points
            .clear();
    }

    /// `name=actions` entries separated by `;` or new lines.
    fn entries(spec: &str) -> Vec<(String, String)> {
        spec.split([';', '\n'])
            .filter_map(|entry| {
                let (name, actions) = entry.trim().split_once('=')?;
                Some((name.trim().to_string(), actions.trim().to_string()))
            })
            .collect()
    }

    fn parse(actions: &str) -> Result<Vec<Action>, String> {
        actions
            .split("->")
            .map(|link| parse_one(link.trim()))
            .collect()
    }

    fn parse_one(link: &str) -> Result<Action, String> {
        let (percent, rest) = match link.split_once('%') {
            Some((p, rest)) => (
                p.parse::<u32>()
                    .ok()
                    .filter(|p| *p <= 100)
                    .ok_or(format!("{p:?} is not a percentage (0-100)"))?,
                rest,
            ),
            None => (100, link),
        };
        let (remaining, rest) = match rest.split_once('*') {
            Some((n, rest)) => (
                Some(
                    n.parse::<u64>()
                        .map_err(|_| format!("{n:?} is not a count"))?,
                ),
                rest,
            ),
            None => (None, rest),
        };
        let (kind, arg) = match rest.split_once('(') {
            Some((kind, arg)) => (
                kind,
                Some(
                    arg.strip_suffix(')')
                        .ok_or(format!("{rest:?}: missing ')'"))?,
                ),
            ),
            None => (rest, None),
        };
        let kind = match (kind, arg) {
            ("off", _) => Kind::Off,
            ("return", arg) => Kind::Return(arg.unwrap_or_default().to_string()),
            ("sleep", Some(ms)) => Kind::Sleep(Duration::from_millis(
                ms.parse()
                    .map_err(|_| format!("sleep({ms}): not milliseconds"))?,
            )),
            _ => {
                return Err(format!(
                    "{link:?}: expected [P%][N*]off|return[(arg)]|sleep(ms)"
                ));
            }
        };
        Ok(Action {
            kind,
            remaining,
            percent,
        })
    }

    /// Applies the file at `path` whenever its modification time changes from `seen`.
    fn watch(path: std::path::PathBuf, mut seen: Option<SystemTime>) {
        loop {
            let modified = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
            if modified.is_some() && modified != seen {
                seen = modified;
                if let Ok(text) = std::fs::read_to_string(&path) {
                    apply_file(&text);
                    acknowledge(&path, &text);
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Writes what this process applied from the file at `path` next to it
    /// (`<path>.applied.<pid>`), so that whoever switched it can wait until it holds.
    fn acknowledge(path: &std::path::Path, text: &str) {
        let mut name = path.as_os_str().to_owned();
        name.push(format!(".applied.{}", std::process::id()));
        let done = std::path::PathBuf::from(&name);
        name.push(".tmp");
        let next = std::path::PathBuf::from(name);
        if std::fs::write(&next, text).is_ok() {
            let _ = std::fs::rename(&next, &done);
        }
    }

    fn apply_file(text: &str) {
        let mut registry = registry().lock().unwrap_or_else(|e| e.into_inner());
        apply_entries(&mut registry, text);
    }

    /// Replaces the failpoints the file set before with those of `text`.
    fn apply_entries(registry: &mut Registry, text: &str) {
        for name in std::mem::take(&mut registry.from_file) {
            registry.points.remove(&name);
        }
        for (name, actions) in entries(text) {
            match parse(&actions) {
                Ok(chain) => {
                    registry.points.insert(name.clone(), chain);
                    registry.from_file.push(name);
                }
                Err(error) => tracing::warn!(failpoint = name, error, "ignored failpoint"),
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_chain_counts_its_evaluations() {
            configure("test.chain", "2*off->1*return(eio)").expect("parses");
            assert_eq!(hit("test.chain"), None);
            assert_eq!(hit("test.chain"), None);
            assert_eq!(hit("test.chain"), Some("eio".into()));
            assert_eq!(hit("test.chain"), None);
            assert_eq!(hit("test.unknown"), None);
        }

        #[test]
        fn bad_actions_are_refused_with_the_reason() {
            assert!(configure("test.bad", "sometimes").is_err());
            assert!(configure("test.bad", "200%return").is_err());
            assert!(configure("test.bad", "x*return").is_err());
            assert!(configure("test.bad", "sleep(soon)").is_err());
            assert_eq!(
                parse("return").expect("parses")[0].kind,
                Kind::Return(String::new())
            );
        }

        #[test]
        fn a_file_switches_off_what_it_no_longer_names() {
            apply_file("test.file.a=return(x)\ntest.file.b=return");
            assert_eq!(hit("test.file.a"), Some("x".into()));
            apply_file("test.file.b=return(y)");
            assert_eq!(hit("test.file.a"), None);
            assert_eq!(hit("test.file.b"), Some("y".into()));
        }
    }
}
