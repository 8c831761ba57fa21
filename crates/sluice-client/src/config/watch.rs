//! Hot reload: the config in force is re-read when its file (or
//! the settings page's overrides file) changes, checked on every request; a
//! broken edit keeps the last good config and is reported.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use sluice_core::Problem;

use super::limits::{LimitsOrigin, ProviderLimits};
use super::load::{ConfigError, load, overrides_path};
use super::pace::PaceConfig;

/// Where a pacer reads the config in force: asked on every request.
pub trait LimitsSource: Send + Sync + 'static {
    /// The config to use for the next decision.
    fn current(&self) -> Arc<PaceConfig>;

    /// The last reload error, if the config in force is older than the file.
    fn last_error(&self) -> Option<String> {
        None
    }

    /// Persists edited limits for `provider` (the settings page) and makes
    /// them current.
    ///
    /// # Errors
    /// [`ConfigError`] when the provider is unknown or the file cannot be
    /// written; the default refuses (nothing to persist to).
    fn save_limits(&self, provider: &str, limits: ProviderLimits) -> Result<(), ConfigError> {
        let _ = (provider, limits);
        Err(ConfigError::Write {
            file: PathBuf::from("<in-memory config>"),
            source: std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "this config has no file to persist to",
            ),
        })
    }

    /// Edits `provider`'s limits with `edit` (given those in force) and
    /// persists the result as [`LimitsSource::save_limits`] does, returning
    /// it. A source that persists reads, edits and writes as one, so that
    /// edits made at once (two settings pages, or two axes of one provider
    /// sent apart) never undo one another.
    ///
    /// # Errors
    /// As [`LimitsSource::save_limits`].
    fn edit_limits(
        &self,
        provider: &str,
        edit: &dyn Fn(ProviderLimits) -> ProviderLimits,
    ) -> Result<ProviderLimits, ConfigError> {
        let current = self
            .current()
            .provider(provider)
            .map(|p| p.limits)
            .unwrap_or_default();
        let limits = edit(current);
        self.save_limits(provider, limits)?;
        Ok(limits)
    }
}

/// A config that never changes, or changes only through
/// [`StaticLimits::set`] / [`LimitsSource::save_limits`] (in memory).
#[derive(Debug)]
pub struct StaticLimits(ArcSwap<PaceConfig>);

impl StaticLimits {
    /// A source always answering `config`.
    pub fn new(config: PaceConfig) -> Self {
        StaticLimits(ArcSwap::from_pointee(config))
    }

    /// Replaces the config (takes effect on the next request).
    pub fn set(&self, config: PaceConfig) {
        self.0.store(Arc::new(config));
    }
}

impl LimitsSource for StaticLimits {
    fn current(&self) -> Arc<PaceConfig> {
        self.0.load_full()
    }

    fn save_limits(&self, provider: &str, limits: ProviderLimits) -> Result<(), ConfigError> {
        let mut c = (*self.0.load_full()).clone();
        let Some(p) = c.providers.get_mut(provider) else {
            return Err(unknown_provider(provider, Path::new("<in-memory config>")));
        };
        p.limits = limits;
        for k in &mut p.api_keys {
            k.follow(limits);
        }
        p.origin = LimitsOrigin::Settings;
        self.set(c);
        Ok(())
    }
}

fn unknown_provider(provider: &str, file: &Path) -> ConfigError {
    ConfigError::Invalid {
        file: file.to_owned(),
        problems: vec![Problem {
            path: format!("providers.{provider}"),
            message: "no such provider in the config".into(),
        }],
    }
}

/// What identifies a version of a file: modification time and length
/// (`None` when the file is absent).
type Stamp = Option<(SystemTime, u64)>;

fn stamp(path: &Path) -> Stamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// A config file watched for changes: [`LimitsSource::current`] compares the
/// files' modification times with the last load's and re-reads them when
/// they differ (no restart, no background task). On a bad edit the last good
/// config stays in force and [`LimitsSource::last_error`] says why.
#[derive(Debug)]
pub struct ConfigWatcher {
    path: PathBuf,
    overrides: PathBuf,
    current: ArcSwap<PaceConfig>,
    state: Mutex<WatchState>,
    /// Held across a save's read, write and load: saves made at once are
    /// made one after the other, none undoing another's edit.
    saving: Mutex<()>,
}

#[derive(Debug)]
struct WatchState {
    stamps: (Stamp, Stamp),
    last_error: Option<String>,
    reloads: u64,
}

impl ConfigWatcher {
    /// Loads `path` (and its overrides file) and watches both.
    ///
    /// # Errors
    /// As [`load`]: a config that does not load at start is an error.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, ConfigError> {
        let path = path.into();
        let overrides = overrides_path(&path);
        let stamps = (stamp(&path), stamp(&overrides));
        let config = load(&path)?;
        Ok(ConfigWatcher {
            path,
            overrides,
            current: ArcSwap::from_pointee(config),
            state: Mutex::new(WatchState {
                stamps,
                last_error: None,
                reloads: 0,
            }),
            saving: Mutex::new(()),
        })
    }

    /// The watched config file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The settings page's overrides file.
    pub fn overrides_file(&self) -> &Path {
        &self.overrides
    }

    /// How many times a changed file was loaded successfully.
    pub fn reloads(&self) -> u64 {
        self.state.lock().reloads
    }

    /// Re-reads the files now if they changed since the last look.
    pub fn check(&self) {
        let now = (stamp(&self.path), stamp(&self.overrides));
        let mut st = self.state.lock();
        if now == st.stamps {
            return;
        }
        st.stamps = now;
        match load(&self.path) {
            Ok(c) => {
                self.current.store(Arc::new(c));
                st.last_error = None;
                st.reloads += 1;
            }
            Err(e) => st.last_error = Some(e.to_string()),
        }
    }
}

impl LimitsSource for ConfigWatcher {
    fn current(&self) -> Arc<PaceConfig> {
        self.check();
        self.current.load_full()
    }

    fn last_error(&self) -> Option<String> {
        self.state.lock().last_error.clone()
    }

    fn save_limits(&self, provider: &str, limits: ProviderLimits) -> Result<(), ConfigError> {
        let _saving = self.saving.lock();
        self.save_holding(provider, limits)
    }

    fn edit_limits(
        &self,
        provider: &str,
        edit: &dyn Fn(ProviderLimits) -> ProviderLimits,
    ) -> Result<ProviderLimits, ConfigError> {
        let _saving = self.saving.lock();
        let Some(current) = self.current().provider(provider).map(|p| p.limits) else {
            return Err(unknown_provider(provider, &self.path));
        };
        let limits = edit(current);
        self.save_holding(provider, limits)?;
        Ok(limits)
    }
}

impl ConfigWatcher {
    /// [`LimitsSource::save_limits`], with `saving` held.
    fn save_holding(&self, provider: &str, limits: ProviderLimits) -> Result<(), ConfigError> {
        let config = self.current();
        if config.provider(provider).is_none() {
            return Err(unknown_provider(provider, &self.path));
        }
        // Every provider already edited keeps its edit.
        let mut edited: Vec<(String, ProviderLimits)> = config
            .providers
            .values()
            .filter(|p| p.origin == LimitsOrigin::Settings && p.name != provider)
            .map(|p| (p.name.clone(), p.limits))
            .collect();
        edited.push((provider.to_owned(), limits));
        edited.sort_by(|a, b| a.0.cmp(&b.0));
        let mut text = format!(
            "# Written by the settings page of `sluice pace`: these limits win over\n# {}. Delete a provider's entry (or this file) to go back to it.\nproviders:\n",
            self.path
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
        );
        for (name, l) in &edited {
            text.push_str(&format!(
                "  {name}:\n    rateLimits: {{ tpm: {}, rpm: {}, rpd: {}, itpm: {}, otpm: {}, tpd: {} }}\n",
                l.tpm, l.rpm, l.rpd, l.itpm, l.otpm, l.tpd
            ));
        }
        let tmp = self.overrides.with_extension("yaml.tmp");
        let write = |p: &Path| std::fs::write(p, &text);
        write(&tmp)
            .and_then(|()| std::fs::rename(&tmp, &self.overrides))
            .map_err(|source| ConfigError::Write {
                file: self.overrides.clone(),
                source,
            })?;
        // Load now rather than on the next look, and fail loudly if the
        // result does not load.
        let c = load(&self.path)?;
        let mut st = self.state.lock();
        st.stamps = (stamp(&self.path), stamp(&self.overrides));
        self.current.store(Arc::new(c));
        st.last_error = None;
        st.reloads += 1;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn overrides_file_sits_next_to_the_config() {
        assert_eq!(
            overrides_path(Path::new("/etc/sluice/pace.yaml")),
            PathBuf::from("/etc/sluice/pace.overrides.yaml")
        );
    }
}
