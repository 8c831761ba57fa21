//! Reading and parsing: a file (or text) → YAML → [`RawConfig`] →
//! [`validate`] → [`PaceConfig`], then the settings page's overrides file
//! next to it.

use std::path::{Path, PathBuf};

use sluice_core::Problem;

use super::limits::LimitsOrigin;
use super::pace::PaceConfig;
use super::raw::{RawConfig, RawOverrides};
use super::validate::{check_limits, validate};

/// Why a config was not accepted (or not saved).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: {source}")]
    Read {
        /// The file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML does not have the config's shape (the message has the line
    /// and column).
    #[error("{file}: {message}")]
    Parse {
        /// The file.
        file: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// The YAML has the right shape but wrong values.
    #[error("{file}: {} problem(s):\n{}", problems.len(), problems.iter().map(|p| format!("  {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        /// The file.
        file: PathBuf,
        /// Every problem found, each with its key path.
        problems: Vec<Problem>,
    },
    /// The settings page's file could not be written.
    #[error("{file}: cannot save: {source}")]
    Write {
        /// The file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl ConfigError {
    /// The problems, when the config parsed but did not validate.
    pub fn problems(&self) -> &[Problem] {
        match self {
            ConfigError::Invalid { problems, .. } => problems,
            _ => &[],
        }
    }
}

/// Reads, parses and validates the config at `path`, then applies the
/// settings page's overrides file next to it ([`overrides_path`]) if present.
///
/// # Errors
/// [`ConfigError`] naming the file, the key path and (for YAML errors) the
/// line.
pub fn load(path: &Path) -> Result<PaceConfig, ConfigError> {
    load_with_env(path, &|name| std::env::var(name).ok())
}

/// [`load`] with variables looked up by `env` instead of the process
/// environment.
///
/// # Errors
/// As [`load`].
pub fn load_with_env(
    path: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<PaceConfig, ConfigError> {
    let text = read(path)?;
    let mut config = parse_str_with_env(&text, path, env)?;
    let over = overrides_path(path);
    match std::fs::read_to_string(&over) {
        Ok(text) => apply_overrides(&mut config, &text, &over)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(ConfigError::Read { file: over, source }),
    }
    Ok(config)
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        file: path.to_owned(),
        source,
    })
}

/// Parses and validates config YAML (no overrides); `file` names it in
/// errors.
///
/// # Errors
/// [`ConfigError::Parse`] or [`ConfigError::Invalid`].
pub fn parse_str(text: &str, file: &Path) -> Result<PaceConfig, ConfigError> {
    parse_str_with_env(text, file, &|name| std::env::var(name).ok())
}

/// [`parse_str`] with variables looked up by `env`.
///
/// # Errors
/// As [`parse_str`].
pub fn parse_str_with_env(
    text: &str,
    file: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<PaceConfig, ConfigError> {
    let raw: RawConfig = serde_saphyr::from_str(text).map_err(|e| ConfigError::Parse {
        file: file.to_owned(),
        message: e.to_string(),
    })?;
    validate(&raw, env).map_err(|problems| ConfigError::Invalid {
        file: file.to_owned(),
        problems,
    })
}

fn apply_overrides(config: &mut PaceConfig, text: &str, file: &Path) -> Result<(), ConfigError> {
    let raw: RawOverrides = serde_saphyr::from_str(text).map_err(|e| ConfigError::Parse {
        file: file.to_owned(),
        message: e.to_string(),
    })?;
    let mut problems = Vec::new();
    for (name, o) in &raw.providers {
        let path = format!("providers.{name}.rateLimits");
        let Some(p) = config.providers.get_mut(name) else {
            problems.push(Problem {
                path: format!("providers.{name}"),
                message: "not a provider of the config file".into(),
            });
            continue;
        };
        let limits = check_limits(&path, Some(&o.rate_limits), None, &mut problems);
        if let Some(mut l) = limits {
            // A file written before the input/output axes keeps the config's.
            if o.rate_limits.itpm.is_none() {
                l.itpm = p.limits.itpm;
            }
            if o.rate_limits.otpm.is_none() {
                l.otpm = p.limits.otpm;
            }
            p.limits = l;
            for k in &mut p.api_keys {
                k.follow(l);
            }
            p.origin = LimitsOrigin::Settings;
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            file: file.to_owned(),
            problems,
        })
    }
}

/// The settings page's file next to `config`: `pace.yaml` →
/// `pace.overrides.yaml`. It holds only edited `rateLimits` and wins over
/// the config file's.
pub fn overrides_path(config: &Path) -> PathBuf {
    let stem = config
        .file_stem()
        .map_or_else(|| "pace".into(), |s| s.to_string_lossy().into_owned());
    config.with_file_name(format!("{stem}.overrides.yaml"))
}
