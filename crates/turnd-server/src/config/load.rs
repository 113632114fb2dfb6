//! Loading a config: the defaults, then the file, then `TURND_*` variables, merged
//! as TOML values before the typed config is read from them. Keys that are none of
//! the known ones are warned about (with the known key most likely meant), not
//! refused; the token file adds `ROLE TOKEN` lines to `auth.tokens`.

use std::collections::BTreeMap;
use std::path::Path;

use turnd_proto::Role;

use super::choice::take_invalid;
use super::{
    Choice, Config, ConfigError, Loaded, LogFormat, StorageSync, TokenConfig, OPTIONAL_KEYS,
};

/// The message for `turns.result_ack_timeout_ms`, a key of earlier versions that
/// nothing in the daemon read: refused, so a file that sets it does not look as if it
/// changed anything.
const RESULT_ACK_TIMEOUT_REFUSED: &str = "turns.result_ack_timeout_ms is not a daemon \
    setting (no daemon ever read it): remove it; a worker's resend interval is set in \
    its SDK (Rust WorkerOptions::result_ack_timeout, Python \
    Worker(result_ack_timeout=...), TypeScript resultAckTimeoutMs)";

impl Config {
    /// Load: defaults, then the file (if any), then `TURND_*` variables from `env`.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Loaded, ConfigError> {
        let defaults = toml::Value::try_from(Config::default())
            .map_err(|e| ConfigError::one(format!("defaults: {e}")))?;
        let mut merged = defaults.clone();
        // Every key turnd knows, the tables that are off by default included: what
        // unknown keys are told from.
        let schema = toml::Value::try_from(Config {
            cluster: Some(Default::default()),
            ..Config::default()
        })
        .map_err(|e| ConfigError::one(format!("defaults: {e}")))?;
        let mut warnings = Vec::new();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| ConfigError::one(format!("read {}: {e}", path.display())))?;
            let file_value: toml::Value = toml::from_str(&text)
                .map_err(|e| ConfigError::one(format!("parse {}: {e}", path.display())))?;
            unknown_keys(&schema, &schema, &file_value, "", &mut warnings);
            merge(&mut merged, file_value);
        }
        let mut problems = Vec::new();
        for (k, v) in env {
            let Some(rest) = k.strip_prefix("TURND_") else {
                continue;
            };
            let Some((section, key)) = rest.split_once("__") else {
                continue;
            };
            let (section, key) = (section.to_ascii_lowercase(), key.to_ascii_lowercase());
            let path = format!("{section}.{key}");
            let known = schema.get(&section).and_then(|s| s.get(&key)).is_some()
                || OPTIONAL_KEYS.contains(&path.as_str());
            if !known {
                warnings.push(format!(
                    "unknown config key {path} (from {k}) ignored{}",
                    did_you_mean(&schema, &path, |p| format!(
                        "TURND_{}",
                        p.to_ascii_uppercase().replacen('.', "__", 1)
                    ))
                ));
                continue;
            }
            let value = parse_env_value(&v);
            match merged.as_table_mut().and_then(|t| {
                t.entry(section.clone())
                    .or_insert_with(|| toml::Value::Table(Default::default()))
                    .as_table_mut()
            }) {
                Some(t) => {
                    t.insert(key, value);
                }
                None => problems.push(format!("{k}: section {section} is not a table")),
            }
        }
        if merged
            .get("turns")
            .and_then(|t| t.get("result_ack_timeout_ms"))
            .is_some()
        {
            problems.push(RESULT_ACK_TIMEOUT_REFUSED.to_string());
        }
        if !problems.is_empty() {
            return Err(ConfigError { problems });
        }
        let mut invalid = BTreeMap::new();
        for (key, problem) in [
            (StorageSync::KEY, take_invalid::<StorageSync>(&mut merged)),
            (LogFormat::KEY, take_invalid::<LogFormat>(&mut merged)),
        ] {
            if let Some(p) = problem {
                invalid.insert(key, p);
            }
        }
        let mut config: Config = merged
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::one(e.to_string()))?;
        config.invalid = invalid;
        if let Some(path) = config.auth.token_file.clone() {
            config.auth.tokens.extend(read_token_file(&path)?);
        }
        Ok(Loaded { config, warnings })
    }
}

/// Read `ROLE TOKEN` lines.
fn read_token_file(path: &Path) -> Result<Vec<TokenConfig>, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::one(format!("read auth.token_file {}: {e}", path.display())))?;
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut parts = line.split_whitespace();
        let role = match parts.next() {
            Some("worker") => Role::Worker,
            Some("client") => Role::Client,
            Some("operator") => Role::Operator,
            other => {
                problems.push(format!(
                    "{}:{}: role must be worker, client or operator, not {:?}",
                    path.display(),
                    n + 1,
                    other.unwrap_or("")
                ));
                continue;
            }
        };
        match (parts.next(), parts.next()) {
            (Some(token), None) => out.push(TokenConfig {
                role,
                token: token.to_string(),
            }),
            _ => problems.push(format!(
                "{}:{}: expected `ROLE TOKEN`",
                path.display(),
                n + 1
            )),
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(ConfigError { problems })
    }
}

fn parse_env_value(v: &str) -> toml::Value {
    // A TOML scalar (number, bool, quoted string, array/inline table) when it parses
    // as one; a bare string otherwise.
    match toml::from_str::<toml::Table>(&format!("v = {v}")) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(v.into())),
        Err(_) => toml::Value::String(v.into()),
    }
}

fn merge(base: &mut toml::Value, over: toml::Value) {
    match (base, over) {
        (toml::Value::Table(b), toml::Value::Table(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(bv) if bv.is_table() && v.is_table() => merge(bv, v),
                    _ => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, o) => *b = o,
    }
}

fn unknown_keys(
    all: &toml::Value,
    defaults: &toml::Value,
    given: &toml::Value,
    prefix: &str,
    out: &mut Vec<String>,
) {
    let (Some(d), Some(g)) = (defaults.as_table(), given.as_table()) else {
        return;
    };
    for (k, v) in g {
        let path = key_path(prefix, k);
        match d.get(k) {
            Some(dv) if dv.is_table() => unknown_keys(all, dv, v, &path, out),
            Some(_) => {}
            None if OPTIONAL_KEYS.contains(&path.as_str()) => {}
            None => out.push(format!(
                "unknown config key {path} ignored{}",
                did_you_mean(all, &path, str::to_string)
            )),
        }
    }
}

/// `"; did you mean X?"` for an unknown key `path`, naming (through `spell`, as the
/// file or the environment writes it) the known key it most likely meant: the most
/// alike key of the same table, or a key of that name in another table (a key put in
/// the wrong section); `""` when none is close.
fn did_you_mean(defaults: &toml::Value, path: &str, spell: impl Fn(&str) -> String) -> String {
    /// How alike (Jaro-Winkler, 0 to 1) two names must be to be offered:
    /// `listen_addr` ~ `listen` is 0.91, `data_dri` ~ `data_dir` 0.97, while
    /// unrelated keys of one table stay below 0.75.
    const ALIKE: f64 = 0.8;
    let (table, name) = path.rsplit_once('.').unwrap_or(("", path));
    let mut known: Vec<String> = Vec::new();
    collect_keys(defaults, "", &mut known);
    known.extend(OPTIONAL_KEYS.iter().map(|k| k.to_string()));
    let split = |k: &str| -> (String, String) {
        match k.rsplit_once('.') {
            Some((t, n)) => (t.to_string(), n.to_string()),
            None => (String::new(), k.to_string()),
        }
    };
    let best = known
        .iter()
        .filter(|k| split(k).0 == table)
        .map(|k| (strsim::jaro_winkler(name, &split(k).1), k))
        .filter(|(score, _)| *score >= ALIKE)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.clone())
        .or_else(|| known.iter().find(|k| split(k).1 == name).cloned());
    match best {
        Some(k) => format!("; did you mean {}?", spell(&k)),
        None => String::new(),
    }
}

/// `prefix.key`, or `key` at the top.
fn key_path(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// Every key of `v` (tables included), as dotted paths under `prefix`.
fn collect_keys(v: &toml::Value, prefix: &str, out: &mut Vec<String>) {
    let Some(t) = v.as_table() else {
        return;
    };
    for (k, v) in t {
        let path = key_path(prefix, k);
        collect_keys(v, &path, out);
        out.push(path);
    }
}
