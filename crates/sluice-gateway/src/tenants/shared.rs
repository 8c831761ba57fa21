//! The tenant table shared by replicas on one Redis: two hashes (workspaces and
//! credentials, one JSON value per entry, `null` for a removal), a version, and a
//! channel. A change is written, counted and published in one script call, so
//! replicas see changes in the order they were made; each replica holds a
//! subscription (no command while nothing changes) and reads the whole table when
//! it subscribes or misses a version.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::StreamExt as _;
use redis::Script;
use sluice_policy::{TenantChange, TenantTable};
use sluice_redis::{Connection, RedisUrl};

/// The channel changes are published on.
pub(super) const CHANNEL: &str = "sluice:tenants";

/// The keys, on one cluster slot.
const WORKSPACES: &str = "{sluice:tenants}:workspaces";
const KEYS: &str = "{sluice:tenants}:keys";
const VERSION: &str = "{sluice:tenants}:version";

/// Writes entries (`ARGV[3..]`: hash, field, JSON value, …; an empty value deletes
/// the field), bumps the version and
/// publishes `<version> <ARGV[2]>` on `ARGV[1]`; returns the version.
const CHANGE: &str = r"
for i = 3, #ARGV, 3 do
  local hash = KEYS[1]
  if ARGV[i] == 'keys' then hash = KEYS[2] end
  if ARGV[i + 2] == '' then
    redis.call('HDEL', hash, ARGV[i + 1])
  else
    redis.call('HSET', hash, ARGV[i + 1], ARGV[i + 2])
  end
end
local version = redis.call('INCR', KEYS[3])
redis.call('PUBLISH', ARGV[1], version .. ' ' .. ARGV[2])
return version
";

/// Returns `{version, workspaces (flat), keys (flat)}`.
const LOAD: &str = r"
local version = tonumber(redis.call('GET', KEYS[3]) or '0')
return {version, redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2])}
";

/// The shared tenant table in one Redis.
pub(super) struct Shared {
    url: RedisUrl,
    conn: Connection,
    change: Script,
    load: Script,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
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
        })
    }

    /// Writes `change` (whose entries `table` holds after it) and publishes it;
    /// returns its version.
    ///
    /// # Errors
    /// Redis did not take it: nothing was written.
    pub(super) async fn write(
        &self,
        change: &TenantChange,
        table: &TenantTable,
    ) -> Result<u64, String> {
        let message = serde_json::to_string(change).map_err(|e| e.to_string())?;
        let mut invocation = self.change.key(WORKSPACES);
        invocation.key(KEYS).key(VERSION).arg(CHANNEL).arg(&message);
        for (hash, field, value) in entries(change, table) {
            invocation.arg(hash).arg(field).arg(value);
        }
        self.conn
            .invoke::<u64>(&invocation)
            .await
            .map_err(|e| e.to_string())
    }

    /// The whole table and its version.
    ///
    /// # Errors
    /// Redis did not answer, or an entry does not read.
    pub(super) async fn load(&self) -> Result<(u64, TenantTable), String> {
        let mut invocation = self.load.key(WORKSPACES);
        invocation.key(KEYS).key(VERSION);
        let (version, workspaces, keys): (u64, Vec<String>, Vec<String>) = self
            .conn
            .invoke(&invocation)
            .await
            .map_err(|e| e.to_string())?;
        Ok((
            version,
            TenantTable {
                workspaces: pairs(workspaces)?,
                keys: pairs(keys)?,
            },
        ))
    }

    /// A subscription to the channel, on the first node of the URL (a cluster
    /// forwards a publication to every node).
    ///
    /// # Errors
    /// Why it cannot be made.
    pub(super) async fn subscribe(&self) -> Result<redis::aio::PubSub, String> {
        let node = self
            .url
            .nodes()
            .first()
            .cloned()
            .ok_or_else(|| "no Redis node".to_owned())?;
        let client = redis::Client::open(node).map_err(|e| e.to_string())?;
        let mut pubsub = tokio::time::timeout(Duration::from_secs(5), client.get_async_pubsub())
            .await
            .map_err(|_| "timed out subscribing".to_owned())?
            .map_err(|e| e.to_string())?;
        pubsub.subscribe(CHANNEL).await.map_err(|e| e.to_string())?;
        Ok(pubsub)
    }
}

/// A publication: the change's version and the change.
pub(super) fn parse_message(payload: &str) -> Option<(u64, TenantChange)> {
    let (version, change) = payload.split_once(' ')?;
    Some((version.parse().ok()?, serde_json::from_str(change).ok()?))
}

/// The next publication of `pubsub`, or `None` when the subscription ended.
pub(super) async fn next_message(pubsub: &mut redis::aio::PubSub) -> Option<String> {
    let message = pubsub.on_message().next().await?;
    message.get_payload::<String>().ok()
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
        TenantChange::RemoveWorkspace { name } => {
            let mut all = vec![workspace(name)];
            // The credentials the removal revoked.
            all.extend(
                table
                    .keys
                    .iter()
                    .filter(|(_, k)| k.is_none())
                    .map(|(sha, _)| key(sha)),
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
