//! A bound on the connections one peer address holds open on a listener, so
//! that one client cannot take every place of a listener's connection bound:
//! the gateway's, the check listener's and the rate-limit service's. Trusted
//! proxies carry many clients and are exempt.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;

use parking_lot::Mutex;

/// Open connections per peer address, at most a bound each but for the
/// exempt addresses. Only addresses holding a connection have an entry.
pub struct PerAddress {
    open: Mutex<HashMap<IpAddr, usize>>,
    max: usize,
    /// Addresses the bound does not apply to (trusted proxies carry many clients).
    exempt: Box<dyn Fn(IpAddr) -> bool + Send + Sync>,
    /// The address a peer is counted as (an IPv6 one by its network).
    group: Box<dyn Fn(IpAddr) -> IpAddr + Send + Sync>,
}

/// One open connection of a peer address, counted until dropped.
pub struct AddressSlot {
    table: Arc<PerAddress>,
    ip: IpAddr,
}

/// A peer address holds its bound of connections already.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0} holds its bound of open connections")]
pub struct AddressFull(pub IpAddr);

impl PerAddress {
    /// At most `max` connections per address, but for those `exempt` says.
    pub fn new(
        max: NonZeroUsize,
        exempt: impl Fn(IpAddr) -> bool + Send + Sync + 'static,
    ) -> Arc<Self> {
        Self::grouped(max, exempt, |ip| ip)
    }

    /// [`PerAddress::new`], each peer counted as the address `group` gives it
    /// (an IPv6 one by its network: its holder has all its addresses).
    pub fn grouped(
        max: NonZeroUsize,
        exempt: impl Fn(IpAddr) -> bool + Send + Sync + 'static,
        group: impl Fn(IpAddr) -> IpAddr + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(PerAddress {
            open: Mutex::default(),
            max: max.get(),
            exempt: Box::new(exempt),
            group: Box::new(group),
        })
    }

    /// A slot for one more connection from `ip`: `None` for an exempt
    /// address (nothing to count).
    ///
    /// # Errors
    /// [`AddressFull`] when `ip` holds its bound.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Option<AddressSlot>, AddressFull> {
        if (self.exempt)(ip) {
            return Ok(None);
        }
        let ip = (self.group)(ip);
        let mut open = self.open.lock();
        let n = open.entry(ip).or_insert(0);
        if *n >= self.max {
            return Err(AddressFull(ip));
        }
        *n += 1;
        Ok(Some(AddressSlot {
            table: Arc::clone(self),
            ip,
        }))
    }

    /// Connections `ip` (its group) holds now.
    pub fn open(&self, ip: IpAddr) -> usize {
        self.open
            .lock()
            .get(&(self.group)(ip))
            .copied()
            .unwrap_or(0)
    }

    /// The bound.
    pub fn max(&self) -> usize {
        self.max
    }
}

impl std::fmt::Debug for PerAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerAddress")
            .field("max", &self.max)
            .field("addresses", &self.open.lock().len())
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for AddressSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddressSlot").field("ip", &self.ip).finish()
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut open = self.table.open.lock();
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_holds_at_most_its_bound_and_a_closed_one_frees_a_place() {
        let trusted: IpAddr = [10, 0, 0, 1].into();
        let table = PerAddress::new(NonZeroUsize::new(2).expect("2"), move |ip| ip == trusted);
        let (one, other): (IpAddr, IpAddr) = ([192, 0, 2, 1].into(), [192, 0, 2, 2].into());
        let first = table.admit(one).expect("a place");
        let second = table.admit(one).expect("a place");
        assert_eq!(table.admit(one).err(), Some(AddressFull(one)));
        assert!(table.admit(other).expect("another address").is_some());
        let proxies: Vec<_> = (0..10).map(|_| table.admit(trusted)).collect();
        assert!(
            proxies.iter().all(|p| matches!(p, Ok(None))),
            "a trusted proxy is not counted"
        );
        drop(first);
        assert!(
            table.admit(one).is_ok(),
            "a closed connection frees its place"
        );
        drop(second);
        assert_eq!(table.open(one), 0, "no entry left behind");
    }

    /// An IPv6 client holds a whole network: counted by it, its addresses share
    /// one bound (else one /64 could take every place of the listener).
    #[test]
    fn addresses_of_one_group_share_its_bound() {
        let net = |ip: IpAddr| match ip {
            IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & (u128::MAX << 64)).into()),
            v4 => v4,
        };
        let table = PerAddress::grouped(NonZeroUsize::new(2).expect("2"), |_| false, net);
        let a: IpAddr = "2001:db8:1:2::1".parse().expect("ip");
        let b: IpAddr = "2001:db8:1:2::2".parse().expect("ip");
        let c: IpAddr = "2001:db8:1:2:ffff::3".parse().expect("ip");
        let other: IpAddr = "2001:db8:1:3::1".parse().expect("ip");
        let _first = table.admit(a).expect("a place");
        let _second = table.admit(b).expect("a place");
        assert!(table.admit(c).is_err(), "the network holds its bound");
        assert!(table.admit(other).is_ok(), "another network has its own");
        assert_eq!(table.open(c), 2);
    }
}
