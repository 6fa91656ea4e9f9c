//! Reading flat configuration files (`--config_path`): a JSON object or simple YAML
//! (`key: value` lines), with keys named like the command-line flags.

use std::path::Path;

/// Why a configuration file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    /// The file could not be read.
    #[error("cannot read configuration file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The contents do not parse.
    #[error("configuration file {path}, line {line}: {reason}")]
    Syntax {
        /// The file.
        path: String,
        /// 1-based line (0 for JSON errors without a line).
        line: usize,
        /// What is wrong.
        reason: String,
    },
}

/// Reads `path` into `(key, value)` pairs; JSON when the file starts with `{`, else
/// YAML-style `key: value` lines (`#` comments, optional quotes).
pub fn read(path: &Path) -> Result<Vec<(String, String)>, ConfigFileError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Io {
        path: name.clone(),
        source,
    })?;
    if text.trim_start().starts_with('{') {
        parse_json(&text).map_err(|(line, reason)| ConfigFileError::Syntax {
            path: name,
            line,
            reason,
        })
    } else {
        parse_yaml(&text).map_err(|(line, reason)| ConfigFileError::Syntax {
            path: name,
            line,
            reason,
        })
    }
}

fn parse_json(text: &str) -> Result<Vec<(String, String)>, (usize, String)> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| (e.line(), e.to_string()))?;
    let object = value
        .as_object()
        .ok_or((0, "expected a JSON object".to_string()))?;
    object
        .iter()
        .map(|(key, value)| {
            let text = match value {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Number(n) => n.to_string(),
                serde_json::Value::Bool(b) => b.to_string(),
                other => {
                    return Err((
                        0,
                        format!("key {key:?}: expected a string, number or boolean, found {other}"),
                    ));
                }
            };
            Ok((key.clone(), text))
        })
        .collect()
}

fn parse_yaml(text: &str) -> Result<Vec<(String, String)>, (usize, String)> {
    let mut pairs = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line = raw.split(" #").next().unwrap_or_default().trim();
        if line.is_empty() || line.starts_with('#') || line == "---" {
            continue;
        }
        let (key, value) = line
            .split_once(':')
            .ok_or((index + 1, format!("expected `key: value`, found {line:?}")))?;
        let value = value.trim().trim_matches(|c| c == '"' || c == '\'');
        pairs.push((key.trim().to_string(), value.to_string()));
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_and_yaml() {
        let pairs = parse_json(r#"{"rpc_port": 50051, "eviction_ratio": 0.1, "enable_offload": true, "cluster_id": "c"}"#).expect("json");
        assert!(pairs.contains(&("rpc_port".into(), "50051".into())));
        assert!(pairs.contains(&("enable_offload".into(), "true".into())));
        assert!(parse_json("[1]").is_err());
        let pairs = parse_yaml(
            "# master\nrpc_port: 50051\nclient_live_ttl_sec: 60  # seconds\ncluster_id: \"c\"\n",
        )
        .expect("yaml");
        assert_eq!(
            pairs,
            vec![
                ("rpc_port".into(), "50051".into()),
                ("client_live_ttl_sec".into(), "60".into()),
                ("cluster_id".into(), "c".into())
            ]
        );
        assert!(parse_yaml("nonsense").is_err());
    }
}
