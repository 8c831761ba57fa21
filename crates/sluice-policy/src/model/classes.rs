//! Cost classes, per-IP ceilings and the profiles' numbers for them.

use std::num::NonZeroU32;

use super::{Algorithm, Consistency, Enforcement, Outage};

/// The most cost classes a policy may declare (a request's classes are a bit set).
pub const MAX_CLASSES: usize = 32;

/// The most per-IP ceilings a policy may declare.
pub const MAX_CEILINGS: usize = 8;

/// A cost class, by its place in the policy's [`Policy::classes`](crate::Policy::classes): every request
/// is counted against its caller's budget of its class. Its name
/// ([`Policy::class_name`](crate::Policy::class_name)) is the policy's: `protocol`, `read`, `standard` and
/// `expensive` in the built-in one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Class(u8);

impl Class {
    /// The class at `index` of a policy's classes, if a policy can have one there.
    pub fn from_index(index: usize) -> Option<Class> {
        u8::try_from(index)
            .ok()
            .filter(|&i| usize::from(i) < MAX_CLASSES)
            .map(Class)
    }

    /// Index into [`Policy::classes`](crate::Policy::classes) and per-class tables.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

/// A set of classes: those a request holds, or those a ceiling is over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ClassSet(u32);

impl ClassSet {
    /// No class.
    pub const EMPTY: ClassSet = ClassSet(0);

    /// This set and `class`.
    #[must_use]
    pub const fn with(self, class: Class) -> ClassSet {
        ClassSet(self.0 | 1 << class.0)
    }

    /// True when `class` is in the set.
    pub const fn contains(self, class: Class) -> bool {
        self.0 & 1 << class.0 != 0
    }

    /// True when the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// True when every class of this set is in `other`.
    pub const fn is_subset(self, other: ClassSet) -> bool {
        self.0 & !other.0 == 0
    }

    /// True when the two sets share a class.
    pub const fn intersects(self, other: ClassSet) -> bool {
        self.0 & other.0 != 0
    }

    /// How many classes the set holds.
    pub const fn len(self) -> usize {
        self.0.count_ones() as usize
    }

    /// The classes, in index order.
    pub fn iter(self) -> impl Iterator<Item = Class> {
        (0..MAX_CLASSES as u8)
            .map(Class)
            .filter(move |c| self.contains(*c))
    }
}

impl FromIterator<Class> for ClassSet {
    fn from_iter<I: IntoIterator<Item = Class>>(iter: I) -> Self {
        iter.into_iter().fold(ClassSet::EMPTY, ClassSet::with)
    }
}

/// A cost class as the policy declares it: its name and how its budgets count.
/// Its limit is the profile's ([`Profile::limit`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CostClass {
    /// Its name in files, headers, metrics, `/status` and logs.
    pub name: String,
    /// Enforced, or decided and counted without refusing (`modes:`).
    pub mode: Enforcement,
    /// How its budgets count (`algorithms:`).
    pub algorithm: Algorithm,
    /// Exact, or leased by replicas (`algorithms.<name>.consistency`, SPEC D4).
    pub consistency: Consistency,
    /// What it does while the shared store cannot be reached (`store.outage`).
    pub outage: Outage,
}

/// A per-IP ceiling: one unit per request from a client IP (IPv6 by prefix),
/// whatever the credential, for the requests it is over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ceiling {
    /// Its name in files, headers, metrics and `/status` (`ip` and `ip_protocol`
    /// in the built-in policy).
    pub name: String,
    /// The classes it is over.
    pub over: ClassSet,
    /// `false`: it counts a request holding any call of its classes; `true`: a
    /// request holding only calls of its classes (the built-in `ip_protocol`).
    pub only: bool,
    /// Enforced, or decided and counted without refusing (`modes:`).
    pub mode: Enforcement,
    /// How it counts (`algorithms:`).
    pub algorithm: Algorithm,
    /// Exact, or leased by replicas (`algorithms.<name>.consistency`, SPEC D4).
    pub consistency: Consistency,
}

impl Ceiling {
    /// True when a request holding the classes `held` counts against it.
    pub fn applies(&self, held: ClassSet) -> bool {
        if self.only {
            held.is_subset(self.over)
        } else {
            held.intersects(self.over)
        }
    }
}

/// One profile's numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Profile {
    /// Per-caller limit per window, indexed by [`Class::index`].
    pub classes: Vec<NonZeroU32>,
    /// Per-IP limit per window, indexed like [`Policy::ceilings`](crate::Policy::ceilings).
    pub ceilings: Vec<NonZeroU32>,
}

impl Profile {
    /// The limit of `class` (the largest there is for a class the policy does not
    /// have, which a checked policy never asks for).
    pub fn limit(&self, class: Class) -> NonZeroU32 {
        self.classes
            .get(class.index())
            .copied()
            .unwrap_or(NonZeroU32::MAX)
    }

    /// The limit of ceiling `i` of [`Policy::ceilings`](crate::Policy::ceilings).
    pub fn ceiling(&self, i: usize) -> NonZeroU32 {
        self.ceilings.get(i).copied().unwrap_or(NonZeroU32::MAX)
    }
}
