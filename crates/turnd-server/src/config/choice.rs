//! Keys whose value is one of a fixed set of names (`storage.sync`, `log.format`):
//! the [`Choice`] trait that parses and names them, and how a value that is none of
//! them is held back from the typed config and reported with every other problem
//! instead of stopping the load at the first.

use serde::{Deserialize, Serialize};

use super::Config;

/// A key whose value is one of a fixed set of names.
pub trait Choice: Sized + Copy + 'static {
    /// The key, `section.name`.
    const KEY: &'static str;
    /// Every value, in the order the messages name them.
    const ALL: &'static [Self];
    /// The value as written in the config.
    fn name(self) -> &'static str;

    /// The value named `s`, or the problem to report.
    fn parse(s: &str) -> Result<Self, String> {
        Self::ALL
            .iter()
            .copied()
            .find(|v| v.name() == s)
            .ok_or_else(|| Self::problem(format_args!("{s:?}")))
    }

    /// The problem with a value that is none of the allowed ones: names them.
    fn problem(given: impl std::fmt::Display) -> String {
        let names: Vec<String> = Self::ALL
            .iter()
            .map(|v| format!("{:?}", v.name()))
            .collect();
        format!("{} must be {}, not {given}", Self::KEY, names.join(" or "))
    }
}

/// `storage.sync`: whether an acknowledgement waits for `fdatasync`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StorageSync {
    /// fsync before every acknowledgement (group-committed). The default.
    #[default]
    Always,
    /// No fsync: acknowledged writes may be lost on power loss. Tests and benchmarks.
    Never,
}

impl Choice for StorageSync {
    const KEY: &'static str = "storage.sync";
    const ALL: &'static [Self] = &[StorageSync::Always, StorageSync::Never];
    fn name(self) -> &'static str {
        match self {
            StorageSync::Always => "always",
            StorageSync::Never => "never",
        }
    }
}

/// `log.format`: how log records are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines. The default.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl Choice for LogFormat {
    const KEY: &'static str = "log.format";
    const ALL: &'static [Self] = &[LogFormat::Text, LogFormat::Json];
    fn name(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

/// Take the value of `C::KEY` out of the merged raw config when it is none of the
/// allowed ones, returning the problem, so that the typed deserialization does not
/// stop at it and the problem is reported with the config's others.
pub(super) fn take_invalid<C: Choice>(merged: &mut toml::Value) -> Option<String> {
    let (section, key) = C::KEY.split_once('.')?;
    let table = merged.get_mut(section)?.as_table_mut()?;
    let problem = match table.get(key)? {
        toml::Value::String(s) => C::parse(s).err()?,
        other => C::problem(other),
    };
    table.remove(key);
    Some(problem)
}

impl Config {
    /// Set `storage.sync` from its name (a command-line flag, say); a name that is
    /// none of the allowed ones is reported by [`Config::validate`].
    pub fn set_storage_sync(&mut self, name: &str) {
        if let Some(v) = self.choose::<StorageSync>(name) {
            self.storage.sync = v;
        }
    }

    /// Set `log.format` from its name; see [`Config::set_storage_sync`].
    pub fn set_log_format(&mut self, name: &str) {
        if let Some(v) = self.choose::<LogFormat>(name) {
            self.log.format = v;
        }
    }

    fn choose<C: Choice>(&mut self, name: &str) -> Option<C> {
        match C::parse(name) {
            Ok(v) => {
                self.invalid.remove(C::KEY);
                Some(v)
            }
            Err(problem) => {
                self.invalid.insert(C::KEY, problem);
                None
            }
        }
    }
}
