//! What a reservation spent, one axis of one budget at a time: written when
//! a request is admitted, read when its permit settles.

use crate::route::TokenAxis;

/// Tokens reserved on one axis of one budget.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Charge {
    pub(crate) subject: u64,
    pub(crate) axis: TokenAxis,
    pub(crate) tokens: u32,
    pub(crate) slot: u64,
    /// The axis's limit in the budget.
    pub(crate) limit: u32,
}
