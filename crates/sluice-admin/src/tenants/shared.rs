//! The tenant table shared by replicas on one Redis: two hashes (workspaces and
//! credentials, one JSON value per entry, `null` for a removal), a version, an
//! epoch, a lineage and a channel. A change is written, counted and published in
//! one script call, so replicas see changes in the order they were made; each
//! replica holds a subscription (no command while nothing changes) and reads the
//! whole table when it subscribes or misses a version.
//!
//! The epoch is a random name the table is made under: a version counts changes
//! within one epoch, so it never goes backwards for a replica, which compares the
//! epoch first. A table Redis lost (`FLUSHALL`, a restart without persistence)
//! has no epoch; a replica that finds it so writes its own copy back under a new
//! epoch, and the lineage (the epochs, each with its last version, that a table
//! was made from) tells every other replica whether that copy holds all it had.

use std::collections::BTreeMap;
use std::time::Duration;

use redis::{Script, ScriptInvocation};
use sluice_policy::{TenantChange, TenantTable};
use sluice_redis::{Connection, RedisUrl};

/// The channel changes are published on.
pub(super) const CHANNEL: &str = "sluice:tenants";

/// The keys, on one cluster slot.
const WORKSPACES: &str = "{sluice:tenants}:workspaces";
const KEYS: &str = "{sluice:tenants}:keys";
const VERSION: &str = "{sluice:tenants}:version";
const EPOCH: &str = "{sluice:tenants}:epoch";
const LINEAGE: &str = "{sluice:tenants}:lineage";

/// The most epochs a lineage names (the latest kept).
const LINEAGE_MAX: usize = 16;

/// Writes entries (`ARGV[5..]`: hash, field, JSON value, …; an empty value deletes
/// the field) when the table's epoch is `ARGV[3]` and its version not below
/// `ARGV[4]` (the writer's last seen), bumps the version and publishes `<epoch>
/// <version> <ARGV[2]>` on `ARGV[1]`; returns `{version, epoch}`, or `{0, epoch
/// now}` (`''`: no table) when the table is another or went back (a failover to a
/// server that had not caught up).
const CHANGE: &str = r"
local epoch = redis.call('GET', KEYS[4])
local version = tonumber(redis.call('GET', KEYS[3]) or '-1')
if not epoch or version < 0 then return {0, ''} end
if epoch ~= ARGV[3] or version < tonumber(ARGV[4]) then return {0, epoch} end
for i = 5, #ARGV, 3 do
  local hash = KEYS[1]
  if ARGV[i] == 'keys' then hash = KEYS[2] end
  if ARGV[i + 2] == '' then
    redis.call('HDEL', hash, ARGV[i + 1])
  else
    redis.call('HSET', hash, ARGV[i + 1], ARGV[i + 2])
  end
end
local version = redis.call('INCR', KEYS[3])
redis.call('PUBLISH', ARGV[1], epoch .. ' ' .. version .. ' ' .. ARGV[2])
return {version, epoch}
";

/// Returns `{epoch, version, lineage, workspaces (flat), keys (flat)}`, epoch `''`
/// when there is no table. A table an earlier sluice made (a version, no epoch)
/// is given the epoch `ARGV[1]`.
const LOAD: &str = r"
local epoch = redis.call('GET', KEYS[4])
local version = redis.call('GET', KEYS[3])
if not version then return {'', 0, '', {}, {}} end
if not epoch then
  epoch = ARGV[1]
  redis.call('SET', KEYS[4], epoch)
end
return {epoch, tonumber(version), redis.call('GET', KEYS[5]) or '',
  redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2])}
";

/// Writes the whole table (`ARGV[5..]`: hash, field, JSON value, …) under the new
/// epoch `ARGV[2]` at version 1 with the lineage `ARGV[4]`, when the table now is
/// `ARGV[3]` (`'<epoch> <version>'`, or `''`: none), and publishes `<epoch> 1
/// reload` on `ARGV[1]`; returns 1, or 0 when the table is not `ARGV[3]`.
const RESTORE: &str = r"
local epoch = redis.call('GET', KEYS[4])
local version = redis.call('GET', KEYS[3])
local now = ''
if epoch and version then now = epoch .. ' ' .. version end
if now ~= ARGV[3] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
for i = 5, #ARGV, 3 do
  local hash = KEYS[1]
  if ARGV[i] == 'keys' then hash = KEYS[2] end
  redis.call('HSET', hash, ARGV[i + 1], ARGV[i + 2])
end
redis.call('SET', KEYS[3], 1)
redis.call('SET', KEYS[4], ARGV[2])
redis.call('SET', KEYS[5], ARGV[4])
redis.call('PUBLISH', ARGV[1], ARGV[2] .. ' 1 reload')
return 1
";

/// Returns `{epoch, version}` (`{'', 0}`: no table).
const EPOCH_NOW: &str = r"
local version = redis.call('GET', KEYS[2])
if not version then return {'', 0} end
return {redis.call('GET', KEYS[1]) or '', tonumber(version)}
";

/// Publishes `ARGV[2]` on `ARGV[1]`; returns how many subscribers heard it.
const PUBLISH: &str = r"
return redis.call('PUBLISH', ARGV[1], ARGV[2])
";

/// The shared tenant table in one Redis.
pub(super) struct Shared {
    url: RedisUrl,
    conn: Connection,
    change: Script,
    load: Script,
    restore: Script,
    epoch: Script,
    publish: Script,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

/// Where a table stands: its epoch (`""`: no table), its version in that epoch,
/// and its lineage.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Stamp {
    /// The random name it was made under (`""`: none).
    pub(super) epoch: String,
    /// Changes made in that epoch (1: as made).
    pub(super) version: u64,
    /// The epochs it was made from, each with its last version (`epoch@version`,
    /// space-separated).
    pub(super) lineage: String,
}

impl Stamp {
    /// The highest version of `epoch` the lineage names.
    pub(super) fn descends_from(&self, epoch: &str) -> Option<u64> {
        lineage_entries(&self.lineage)
            .filter(|(e, _)| *e == epoch)
            .map(|(_, v)| v)
            .max()
    }

    /// The lineage of a table made from `self` and the tables (epoch, version,
    /// lineage) of `others`: every epoch each names, and each of them.
    pub(super) fn lineage_with(&self, others: &[&Stamp]) -> String {
        let mut all: Vec<(String, u64)> = Vec::new();
        for stamp in std::iter::once(self).chain(others.iter().copied()) {
            let own = (!stamp.epoch.is_empty()).then_some((stamp.epoch.as_str(), stamp.version));
            for (epoch, version) in lineage_entries(&stamp.lineage).chain(own) {
                match all.iter_mut().find(|(e, _)| e == epoch) {
                    Some(entry) => entry.1 = entry.1.max(version),
                    None => all.push((epoch.to_owned(), version)),
                }
            }
        }
        let skip = all.len().saturating_sub(LINEAGE_MAX);
        all.iter()
            .skip(skip)
            .map(|(e, v)| format!("{e}@{v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

fn lineage_entries(lineage: &str) -> impl Iterator<Item = (&str, u64)> {
    lineage.split_whitespace().filter_map(|entry| {
        let (epoch, version) = entry.rsplit_once('@')?;
        Some((epoch, version.parse().ok()?))
    })
}

/// What a replica holding `held` (as `mine`) does with the table Redis holds
/// (`table`, as `now`).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Repair {
    /// Takes it: it holds all this replica had.
    Take,
    /// Takes it, though changes this replica saw are missing from it (it was
    /// changed since it was made from an older copy): why, for an error line.
    TakeIncomplete(String),
    /// Writes `table` back under a new epoch: `kind` names the repair (`None`:
    /// an empty table made where there was none, not a repair), `why` says it.
    Write {
        /// What to write.
        table: TenantTable,
        /// `restored`, `newer` or `merged`.
        kind: Option<&'static str>,
        /// Why, for an error line.
        why: String,
    },
}

/// What a replica holding `held` (as `mine`) does with the table Redis holds
/// (`table`, as `now`; epoch `""`: none):
/// - none: writes its copy back (an empty one when it holds nothing);
/// - its epoch at a version below the one it saw (a failover to a server that
///   had not caught up): writes its copy over it;
/// - another epoch whose lineage names this replica's at its version or later
///   (a copy of all it had): takes it;
/// - one made from an older copy of this replica's epoch: writes its newer copy
///   over it if nothing changed since (version 1), else takes it, incomplete;
/// - one made without this replica's epoch (by a replica that held no copy):
///   adds the entries it lacks (its own entries, newer, stay).
pub(super) fn repair(mine: &Stamp, held: &TenantTable, now: &Stamp, table: &TenantTable) -> Repair {
    let holds = !(held.workspaces.is_empty() && held.keys.is_empty());
    let write = |table: &TenantTable, kind: &'static str, why: String| Repair::Write {
        table: table.clone(),
        kind: Some(kind),
        why,
    };
    if now.epoch.is_empty() {
        if !holds {
            return Repair::Write {
                table: TenantTable::default(),
                kind: None,
                why: String::new(),
            };
        }
        return write(
            held,
            "restored",
            format!(
                "the shared tenant table is gone from Redis (FLUSHALL, or a restart without persistence): writing back this replica's copy ({} workspaces, {} credentials, epoch {} version {})",
                held.workspaces.len(),
                held.keys.len(),
                mine.epoch,
                mine.version
            ),
        );
    }
    if now.epoch == mine.epoch && now.version < mine.version && holds {
        return write(
            held,
            "newer",
            format!(
                "the shared tenant table went back from version {} to {} (a failover to a server that had not caught up?): writing this replica's copy over it",
                mine.version, now.version
            ),
        );
    }
    if now.epoch == mine.epoch || mine.epoch.is_empty() || !holds {
        return Repair::Take;
    }
    match now.descends_from(&mine.epoch) {
        Some(version) if version >= mine.version => Repair::Take,
        Some(version) if now.version > 1 => Repair::TakeIncomplete(format!(
            "the shared tenant table was made again from an older copy (epoch {} version {version}, this replica had version {}) and changed since: changes made before Redis lost it may be missing; check GET /tenants",
            mine.epoch, mine.version
        )),
        Some(version) => write(
            held,
            "newer",
            format!(
                "the shared tenant table was made again from an older copy (epoch {} version {version}): writing this replica's newer one (version {}) over it",
                mine.epoch, mine.version
            ),
        ),
        None => {
            let mut merged = table.clone();
            for (name, entry) in &held.workspaces {
                merged
                    .workspaces
                    .entry(name.clone())
                    .or_insert_with(|| entry.clone());
            }
            for (sha, entry) in &held.keys {
                merged
                    .keys
                    .entry(sha.clone())
                    .or_insert_with(|| entry.clone());
            }
            let added = merged.workspaces.len() + merged.keys.len()
                - table.workspaces.len()
                - table.keys.len();
            if added == 0 {
                return Repair::Take;
            }
            let why = format!(
                "the shared tenant table was made again without this replica's copy (epoch {} now, this replica had {} version {}): adding the {added} entries it lacks",
                now.epoch, mine.epoch, mine.version
            );
            write(&merged, "merged", why)
        }
    }
}

/// A new epoch: 128 random bits in hex.
pub(super) fn new_epoch() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    let half = |salt: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(salt);
        h.write_u32(std::process::id());
        if let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(now.as_nanos());
        }
        h.finish()
    };
    format!("{:016x}{:016x}", half(1), half(2))
}

/// What a change written met.
pub(super) enum Written {
    /// It was made.
    Made,
    /// The table is not the one this replica holds (made again, or none):
    /// nothing was written.
    Reset,
}

impl Shared {
    /// Connects to the Redis at `url`.
    ///
    /// # Errors
    /// Why Redis cannot be reached.
    pub(super) async fn connect(url: &str, timeout: Duration) -> Result<Shared, String> {
        let parsed = RedisUrl::parse(url).map_err(|e| e.to_string())?;
        let conn = Connection::connect(&parsed, timeout)
            .await
            .map_err(|e| e.to_string())?;
        Ok(Shared {
            url: parsed,
            conn,
            change: Script::new(CHANGE),
            load: Script::new(LOAD),
            restore: Script::new(RESTORE),
            epoch: Script::new(EPOCH_NOW),
            publish: Script::new(PUBLISH),
        })
    }

    /// Writes `change` (whose entries `table` holds after it) and publishes it,
    /// when the table is the one `seen` names (its epoch, a version not below).
    ///
    /// # Errors
    /// Redis did not take it: nothing was written.
    pub(super) async fn write(
        &self,
        change: &TenantChange,
        table: &TenantTable,
        seen: &Stamp,
    ) -> Result<Written, String> {
        let message = serde_json::to_string(change).map_err(|e| e.to_string())?;
        let mut invocation = on_table(&self.change);
        invocation
            .arg(CHANNEL)
            .arg(&message)
            .arg(&seen.epoch)
            .arg(seen.version);
        for (hash, field, value) in entries(change, table) {
            invocation.arg(hash).arg(field).arg(value);
        }
        let (version, _now): (u64, String) = self
            .conn
            .invoke(&invocation)
            .await
            .map_err(|e| e.to_string())?;
        Ok(if version == 0 {
            Written::Reset
        } else {
            Written::Made
        })
    }

    /// The whole table and where it stands (epoch `""`: there is none).
    ///
    /// # Errors
    /// Redis did not answer, or an entry does not read.
    pub(super) async fn load(&self) -> Result<(Stamp, TenantTable), String> {
        let mut invocation = on_table(&self.load);
        invocation.arg(new_epoch());
        let (epoch, version, lineage, workspaces, keys): (
            String,
            u64,
            String,
            Vec<String>,
            Vec<String>,
        ) = self
            .conn
            .invoke(&invocation)
            .await
            .map_err(|e| e.to_string())?;
        Ok((
            Stamp {
                epoch,
                version,
                lineage,
            },
            TenantTable {
                workspaces: pairs(workspaces)?,
                keys: pairs(keys)?,
            },
        ))
    }

    /// Writes `table` whole under the new epoch `stamp.epoch` (version 1) with
    /// `stamp.lineage`, when the table in Redis is still `now` (`None`: there is
    /// none), and tells every replica to read it; whether it was written.
    ///
    /// # Errors
    /// Redis did not answer.
    pub(super) async fn restore(
        &self,
        table: &TenantTable,
        stamp: &Stamp,
        now: Option<&Stamp>,
    ) -> Result<bool, String> {
        let expected = now.map_or_else(String::new, |s| format!("{} {}", s.epoch, s.version));
        let mut invocation = on_table(&self.restore);
        invocation
            .arg(CHANNEL)
            .arg(&stamp.epoch)
            .arg(expected)
            .arg(&stamp.lineage);
        for (name, entry) in &table.workspaces {
            invocation.arg("workspaces").arg(name).arg(json(entry));
        }
        for (sha, entry) in &table.keys {
            invocation.arg("keys").arg(sha).arg(json(entry));
        }
        let written: u8 = self
            .conn
            .invoke(&invocation)
            .await
            .map_err(|e| e.to_string())?;
        Ok(written == 1)
    }

    /// The table's epoch and version now (`""`: there is none).
    ///
    /// # Errors
    /// Redis did not answer.
    pub(super) async fn now(&self) -> Result<(String, u64), String> {
        let mut invocation = self.epoch.key(EPOCH);
        invocation.key(VERSION);
        self.conn
            .invoke(&invocation)
            .await
            .map_err(|e| e.to_string())
    }

    /// Asks every replica to read the table again (and so to write its copy back
    /// when the table is gone); how many subscribers heard it (the asker's own
    /// subscription included).
    ///
    /// # Errors
    /// Redis did not answer.
    pub(super) async fn ask_for_copies(&self) -> Result<u64, String> {
        let mut invocation = self.publish.prepare_invoke();
        invocation.arg(CHANNEL).arg(REQUEST);
        self.conn
            .invoke::<u64>(&invocation)
            .await
            .map_err(|e| e.to_string())
    }

    /// A subscription to the channel, where the table's publications are heard
    /// (see [`Connection::subscriber`](sluice_redis::Connection::subscriber)).
    ///
    /// # Errors
    /// Why it cannot be made.
    pub(super) async fn subscribe(&self) -> Result<redis::aio::PubSub, String> {
        let client = self.conn.subscriber(&self.url).map_err(|e| e.to_string())?;
        let mut pubsub = tokio::time::timeout(Duration::from_secs(5), client.get_async_pubsub())
            .await
            .map_err(|_| "timed out subscribing".to_owned())?
            .map_err(|e| e.to_string())?;
        pubsub.subscribe(CHANNEL).await.map_err(|e| e.to_string())?;
        Ok(pubsub)
    }
}

/// A call of `script` on the table's keys: its workspaces, keys, version, epoch and
/// lineage, in that order (`KEYS[1]` to `KEYS[5]` of every script that reads or
/// writes the table).
fn on_table(script: &Script) -> ScriptInvocation<'_> {
    let mut invocation = script.key(WORKSPACES);
    invocation.key(KEYS).key(VERSION).key(EPOCH).key(LINEAGE);
    invocation
}

/// The publication that asks every replica to read the table again.
const REQUEST: &str = "- 0 reload";

/// A publication: the epoch, the version, and the change (`None`: read the whole
/// table).
pub(super) fn parse_message(payload: &str) -> Option<(&str, u64, Option<TenantChange>)> {
    let (epoch, rest) = payload.split_once(' ')?;
    let (version, body) = rest.split_once(' ')?;
    let change = if body == "reload" {
        None
    } else {
        Some(serde_json::from_str(body).ok()?)
    };
    Some((epoch, version.parse().ok()?, change))
}

/// The entries `change` writes: (hash, field, JSON value) as `table` holds them.
fn entries(change: &TenantChange, table: &TenantTable) -> Vec<(&'static str, String, String)> {
    // `null`: removed over the file's; absent (an empty value): gone.
    let workspace = |name: &str| {
        (
            "workspaces",
            name.to_owned(),
            table.workspaces.get(name).map_or_else(String::new, json),
        )
    };
    let key = |sha: &str| {
        (
            "keys",
            sha.to_owned(),
            json(&table.keys.get(sha).cloned().flatten()),
        )
    };
    match change {
        TenantChange::PutWorkspace { name, .. } => vec![workspace(name)],
        TenantChange::RemoveWorkspace { name, revoked } => {
            let mut all = vec![workspace(name)];
            // The credentials the removal revoked (the change is resolved).
            all.extend(
                revoked
                    .iter()
                    .flatten()
                    .map(|sha| key(&sha.to_ascii_lowercase())),
            );
            all
        }
        TenantChange::PutKey { sha256, .. } | TenantChange::RevokeKey { sha256 } => {
            vec![key(&sha256.to_ascii_lowercase())]
        }
    }
}

/// JSON of an entry, for [`entries`].
fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| "null".to_owned())
}

/// A flat `HGETALL` answer read into entries.
fn pairs<T: serde::de::DeserializeOwned>(flat: Vec<String>) -> Result<BTreeMap<String, T>, String> {
    let mut out = BTreeMap::new();
    let mut flat = flat.into_iter();
    while let (Some(field), Some(value)) = (flat.next(), flat.next()) {
        let value = serde_json::from_str(&value).map_err(|e| format!("tenant {field}: {e}"))?;
        out.insert(field, value);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(epoch: &str, version: u64, lineage: &str) -> Stamp {
        Stamp {
            epoch: epoch.to_owned(),
            version,
            lineage: lineage.to_owned(),
        }
    }

    #[test]
    fn p4_a_lineage_names_every_epoch_a_table_was_made_from_at_its_last_version() {
        let restored = stamp("b", 1, &stamp("a", 7, "").lineage_with(&[]));
        assert_eq!(restored.lineage, "a@7");
        assert_eq!(restored.descends_from("a"), Some(7));
        assert_eq!(
            restored.descends_from("b"),
            None,
            "its own epoch is not in it"
        );
        let merged = restored.lineage_with(&[&stamp("c", 3, "a@9")]);
        assert_eq!(merged, "a@9 b@1 c@3", "the highest version of each epoch");
        let long = (0..40).fold(Stamp::default(), |s, i| {
            stamp(&format!("e{i}"), 1, &s.lineage_with(&[]))
        });
        assert_eq!(long.lineage.split(' ').count(), LINEAGE_MAX);
        assert_eq!(long.descends_from("e38"), Some(1), "the latest kept");
    }

    fn revoked(n: u8) -> TenantTable {
        let mut table = TenantTable::default();
        table.keys.insert(format!("{n:02x}").repeat(32), None);
        table
    }

    fn kind(repair: &Repair) -> Option<&'static str> {
        match repair {
            Repair::Take => Some("take"),
            Repair::TakeIncomplete(_) => Some("incomplete"),
            Repair::Write { kind, .. } => *kind,
        }
    }

    #[test]
    fn p4_a_replica_writes_its_copy_back_when_redis_lost_or_rolled_the_table_back() {
        let mine = stamp("e1", 5, "");
        let held = revoked(1);
        let none = TenantTable::default();
        // Gone: the copy written back; nothing held: an empty table made.
        let gone = repair(&mine, &held, &Stamp::default(), &none);
        assert!(
            matches!(&gone, Repair::Write { table, kind: Some("restored"), .. } if *table == held)
        );
        let empty = repair(&mine, &none, &Stamp::default(), &none);
        assert_eq!(
            empty,
            Repair::Write {
                table: none.clone(),
                kind: None,
                why: String::new()
            }
        );
        // The same epoch: taken, unless its version went back.
        assert_eq!(
            kind(&repair(&mine, &held, &stamp("e1", 7, ""), &held)),
            Some("take")
        );
        let back = repair(&mine, &held, &stamp("e1", 3, ""), &none);
        assert!(
            matches!(&back, Repair::Write { table, kind: Some("newer"), .. } if *table == held)
        );
        // Made again from this replica's epoch: taken when it holds all this one
        // had; else this one's newer copy written, if nothing changed since.
        assert_eq!(
            kind(&repair(&mine, &held, &stamp("e2", 4, "e1@5"), &held)),
            Some("take")
        );
        assert_eq!(
            kind(&repair(&mine, &held, &stamp("e2", 1, "e1@4"), &none)),
            Some("newer")
        );
        assert_eq!(
            kind(&repair(&mine, &held, &stamp("e2", 2, "e1@4"), &none)),
            Some("incomplete")
        );
    }

    #[test]
    fn p4_a_table_made_without_a_replicas_copy_gets_its_entries_and_no_revocation_undone() {
        let mine = stamp("e1", 5, "");
        // This replica holds credential 01 revoked and 02 set; the table made
        // meanwhile by a replica without a copy set 01 again and revoked 03.
        let mut held = revoked(1);
        held.keys.insert(
            "02".repeat(32),
            Some(sluice_policy::TenantKey {
                workspace: "acme".to_owned(),
                user: "ada".to_owned(),
            }),
        );
        let mut table = revoked(3);
        table.keys.insert(
            "01".repeat(32),
            Some(sluice_policy::TenantKey {
                workspace: "acme".to_owned(),
                user: "bo".to_owned(),
            }),
        );
        let Repair::Write {
            table: merged,
            kind: Some("merged"),
            ..
        } = repair(&mine, &held, &stamp("e9", 2, ""), &table)
        else {
            panic!("a merge");
        };
        assert!(
            merged.keys["01".repeat(32).as_str()].is_some(),
            "the newer entry stays"
        );
        assert!(
            merged.keys["02".repeat(32).as_str()].is_some(),
            "the missing one added"
        );
        assert!(
            merged.keys["03".repeat(32).as_str()].is_none(),
            "still revoked"
        );
        // Nothing lacking: taken.
        assert_eq!(
            kind(&repair(&mine, &held, &stamp("e9", 2, ""), &merged)),
            Some("take")
        );
    }

    #[test]
    fn p4_a_publication_names_its_epoch_and_version() {
        let change = r#"{"op":"revoke_key","sha256":"ab"}"#;
        let payload = format!("e1 7 {change}");
        let (epoch, version, parsed) = parse_message(&payload).expect("a change");
        assert_eq!((epoch, version), ("e1", 7));
        assert!(matches!(parsed, Some(TenantChange::RevokeKey { .. })));
        assert!(matches!(
            parse_message("e2 1 reload"),
            Some(("e2", 1, None))
        ));
        assert!(matches!(parse_message(REQUEST), Some(("-", 0, None))));
        assert!(
            parse_message("7 {}").is_none(),
            "an earlier sluice's: not read"
        );
        assert_ne!(new_epoch(), new_epoch());
    }
}
