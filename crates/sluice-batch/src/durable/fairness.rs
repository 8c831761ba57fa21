//! Which workspace's item a runner claims next.

use redb::{ReadableTable as _, WriteTransaction};

use super::TxError;
use super::schema::WORKSPACES;

/// The workspace with queued items and the fewest running; ties go to the one
/// whose last claim is oldest, then by name.
pub(super) fn fairest(tx: &WriteTransaction) -> Result<Option<String>, TxError> {
    let table = tx.open_table(WORKSPACES)?;
    let mut best: Option<((u64, u64), String)> = None;
    for row in table.iter()? {
        let (k, v) = row?;
        let (queued, running, last) = v.value();
        if queued == 0 {
            continue;
        }
        let rank = (running, last);
        if best.as_ref().is_none_or(|(b, _)| rank < *b) {
            best = Some((rank, k.value().to_owned()));
        }
    }
    Ok(best.map(|(_, w)| w))
}
