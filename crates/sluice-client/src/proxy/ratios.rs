//! The input ratios the pacer learned (the provider's input count to its
//! estimate, per provider and model), kept across restarts of `sluice pace`
//! in a file next to the config: `pace.yaml` → `pace.ratios.json`, written
//! every [`SAVE_EVERY`] when it changed and when the proxy stops, read when
//! it starts. The file is the pacer's own (not an edit of the operator's):
//! a missing, unreadable or malformed file is learned again from scratch.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sluice_core::Clock;
use sluice_store::BudgetStore;

use crate::pacer::Pacer;

/// How often the learned ratios are written (when they changed).
pub const SAVE_EVERY: Duration = Duration::from_secs(60);

/// The largest ratios file read (a larger one is ignored).
const MAX_FILE_BYTES: u64 = 4 << 20;

/// The learned ratios' file next to `config`: `pace.yaml` →
/// `pace.ratios.json`.
pub fn ratios_path(config: &Path) -> PathBuf {
    let stem = config
        .file_stem()
        .map_or_else(|| "pace".into(), |s| s.to_string_lossy().into_owned());
    config.with_file_name(format!("{stem}.ratios.json"))
}

/// The file's content: `{"version":1,"providers":{"openai":[{"model":"gpt-4o",
/// "ratio":1.3,"samples":40,"factor":1.3}]}}`.
pub(super) fn to_json<S: BudgetStore + 'static, C: Clock + 'static>(
    pacer: &Pacer<S, C>,
) -> serde_json::Value {
    serde_json::json!({ "version": 1, "providers": pacer.all_input_ratios() })
}

/// Restores the ratios of `file` into `pacer`; how many were restored.
/// Anything malformed is skipped.
pub(super) fn load<S: BudgetStore + 'static, C: Clock + 'static>(
    pacer: &Pacer<S, C>,
    file: &Path,
) -> usize {
    let too_big = std::fs::metadata(file).map_or(true, |m| m.len() > MAX_FILE_BYTES);
    if too_big {
        return 0;
    }
    let Ok(text) = std::fs::read(file) else {
        return 0;
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&text) else {
        tracing::warn!(file = %file.display(), "ignoring a malformed ratios file");
        return 0;
    };
    let Some(providers) = v.get("providers").and_then(|p| p.as_object()) else {
        return 0;
    };
    let mut n = 0;
    for (provider, models) in providers {
        for m in models.as_array().into_iter().flatten() {
            let (Some(model), Some(ratio), Some(samples)) = (
                m.get("model").and_then(|x| x.as_str()),
                m.get("ratio").and_then(serde_json::Value::as_f64),
                m.get("samples").and_then(serde_json::Value::as_u64),
            ) else {
                continue;
            };
            let samples = u32::try_from(samples).unwrap_or(u32::MAX);
            pacer.restore_input_ratio(provider, model, ratio, samples);
            n += 1;
        }
    }
    n
}

/// Writes `content` to `file` whole (a temporary file renamed over it).
///
/// # Errors
/// The file system's.
pub(super) fn save(content: &serde_json::Value, file: &Path) -> std::io::Result<()> {
    let tmp = file.with_extension("json.tmp");
    std::fs::write(&tmp, content.to_string())?;
    std::fs::rename(&tmp, file)
}

/// Writes the pacer's ratios to `file` when they differ from `last`
/// (updated); errors are logged (a warning the first time, `warned`, then
/// at debug level), never fatal.
pub(super) fn save_if_changed<S: BudgetStore + 'static, C: Clock + 'static>(
    pacer: &Pacer<S, C>,
    file: &Path,
    last: &mut serde_json::Value,
    warned: &mut bool,
) {
    let now = to_json(pacer);
    if now == *last {
        return;
    }
    match save(&now, file) {
        Ok(()) => *last = now,
        Err(e) if !*warned => {
            *warned = true;
            tracing::warn!(file = %file.display(), error = %e, "could not save the learned input ratios");
        }
        Err(e) => {
            tracing::debug!(file = %file.display(), error = %e, "could not save the learned input ratios");
        }
    }
}
