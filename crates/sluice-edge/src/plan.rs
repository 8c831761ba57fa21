//! From a classified request to the budgets it spends: its class budgets,
//! one IP ceiling, any route buckets (weighted ones too) and monthly quotas,
//! decided together.

use std::num::NonZeroU32;

use arrayvec::ArrayVec;
use sluice_core::{Budget, BudgetKey, Decision, MAX_BUDGETS, Rate, digest, month_of};
use sluice_policy::{
    Algorithm, Caller, Class, ClientIp, CustomerPlan, Enforcement, Items, OnExhausted, Per, Policy,
    Refusal,
};

/// What a budget of a plan is, for headers, refusals and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BudgetKind {
    /// The caller's budget of a class.
    Class(Class),
    /// A per-IP ceiling (index into the policy's ceilings).
    Ceiling(u32),
    /// A route bucket (index into the policy's buckets).
    Bucket(u32),
    /// A monthly quota (index into the policy's quota families).
    Quota(u32),
    /// The turns an agent run may still take (SPEC T7).
    Turns,
    /// The turns an agent run took (a count: never refuses).
    TurnsTaken,
    /// The runs a caller may start per `turns.idle_seconds`.
    RunStarts,
}

/// A policy index as a [`BudgetKind`] holds it (four bytes rather than eight: a
/// plan of twelve kinds stays under the allocator's small-block size). No policy
/// has four billion buckets; an index past `u32::MAX` would name no bucket, and
/// its budget is still counted.
fn kind_index(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

/// The policy index a [`BudgetKind`] holds.
pub(crate) fn policy_index(i: u32) -> usize {
    usize::try_from(i).unwrap_or(usize::MAX)
}

/// Seconds, rounded up, never below 1: what `Retry-After` says.
pub fn retry_after_secs(d: std::time::Duration) -> u64 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    secs.max(1)
}

/// A weighted budget that was exhausted and passed on to the upstream instead
/// of refusing the request (`on_exhausted: pass`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Passed {
    /// The budget's index in the plan.
    pub index: usize,
    /// Seconds until it has room again.
    pub retry_after: u64,
}

/// The budgets of one request, with what each one is.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The budgets, in decision order.
    pub budgets: ArrayVec<Budget, MAX_BUDGETS>,
    /// What each budget is, in the same order.
    pub kinds: ArrayVec<BudgetKind, MAX_BUDGETS>,
    /// Window of each budget in seconds (for `RateLimit-Policy`).
    pub windows: ArrayVec<u32, MAX_BUDGETS>,
    /// The costliest class the request holds, the last in the policy's order (for
    /// metrics).
    pub top_class: Class,
    /// The caller's subject digest.
    pub caller: u64,
    /// The client's network digest (see [`sluice_policy::ClientIp::network`]),
    /// for the store's overflow budgets.
    pub network: u64,
    /// The caller as logs and the status page show it.
    pub who: sluice_policy::Who,
    /// Who the request is from: its workspace and user for the upstream.
    pub from: Caller,
    /// A weighted budget passed on exhausted (set by the decision).
    pub passed: Option<Passed>,
    /// The call through a guarded lane the request makes, if it makes one.
    pub lane: Option<crate::LaneCall>,
    /// The LLM wire format of its route, when it is an LLM call: its token
    /// budgets settle at the upstream's `usage`, its refusals and headers speak
    /// that API's dialect.
    pub llm: Option<sluice_policy::LlmFormat>,
    /// The index of the LLM call's model's price in the policy's `prices:`: its
    /// money budgets settle at it.
    pub price: Option<u16>,
    /// What the LLM call reserved (its estimated input and the output it
    /// names), when it is one: what its budgets keep, and its usage counts, when
    /// it ends without a `usage` to settle at.
    pub reservation: Option<crate::tokens::Reservation>,
    /// The agent run the call is a turn of (SPEC T7), if it is one.
    pub run: Option<Box<crate::PlannedRun>>,
    /// The budgets in shadow mode, a bit each by index (`mode: shadow`, a shadowed
    /// route, or a dry run): decided and counted, never refusing.
    pub shadow: u16,
    /// Those of them that would have refused this request (set by the decision):
    /// it was admitted as if they were off.
    pub shadowed: u16,
}

// A bit per budget in `Plan::shadow`.
const _: () = assert!(MAX_BUDGETS <= 16);

// Every request allocates its plan: within mimalloc's small blocks (1 KiB) the
// allocation takes its fast path, a quarter of the instructions of the generic one.
const _: () = assert!(std::mem::size_of::<Plan>() <= 1024);

/// Digests of every scope name, computed once per policy.
#[derive(Clone, Debug)]
pub struct Scopes {
    classes: Vec<u64>,
    ceilings: Vec<u64>,
    buckets: Vec<u64>,
    quotas: Vec<u64>,
}

/// The scope digest of the budget named `name` counted by `algorithm` over `window`
/// seconds: a fixed window's is its name's (as before algorithms existed); any
/// other's names its algorithm too (and a sliding window its slot width), so a
/// reload that changes how a budget counts starts it afresh rather than reading
/// cells written another way.
fn scope(name: &str, algorithm: Algorithm, window: NonZeroU32) -> u64 {
    match algorithm {
        Algorithm::Fixed => digest(name.as_bytes()),
        Algorithm::Sliding => match algorithm.rate(window, NonZeroU32::MIN) {
            Rate::RollingWindow { slot_millis, .. } => {
                digest(format!("{name}:sliding:{slot_millis}").as_bytes())
            }
            _ => digest(format!("{name}:sliding").as_bytes()),
        },
        Algorithm::Gcra { .. } => digest(format!("{name}:gcra").as_bytes()),
    }
}

impl Scopes {
    /// The scopes of `policy`.
    pub fn new(policy: &Policy) -> Self {
        let window = policy.window;
        Scopes {
            classes: policy
                .classes
                .iter()
                .map(|c| scope(&format!("class:{}", c.name), c.algorithm, window))
                .collect(),
            ceilings: policy
                .ceilings
                .iter()
                .map(|c| scope(&format!("ceiling:{}", c.name), c.algorithm, window))
                .collect(),
            buckets: policy
                .buckets
                .iter()
                .map(|b| scope(&format!("bucket:{}", b.name), b.algorithm, b.window))
                .collect(),
            quotas: policy
                .quotas
                .iter()
                .map(|q| digest(format!("quota:{}", q.name).as_bytes()))
                .collect(),
        }
    }
}

impl Scopes {
    /// The scope digest of quota family `i`.
    pub(crate) fn quota(&self, i: usize) -> Option<&u64> {
        self.quotas.get(i)
    }
}

/// The monthly budget of a family (scope `scope`) capped at `monthly` (`None`:
/// uncapped) of the workspace `workspace`.
pub(crate) fn quota_budget(
    scope: u64,
    monthly: Option<NonZeroU32>,
    workspace: u64,
    cost: u32,
) -> Budget {
    Budget {
        key: BudgetKey::from_digests(scope, workspace),
        rate: Rate::CalendarMonth,
        limit: monthly.map_or(u32::MAX, NonZeroU32::get),
        cost,
    }
}

/// The monthly cap of quota family `i` for a workspace on `tier`: the plan's, else
/// the family's (`None`: uncapped).
pub(crate) fn quota_cap(
    policy: &Policy,
    tier: Option<&CustomerPlan>,
    i: usize,
) -> Option<NonZeroU32> {
    overridden(tier.map(|t| &t.quotas), i).or_else(|| policy.quotas.get(i).and_then(|q| q.monthly))
}

/// A plan's override at `i` of one of its tables, if it sets one.
fn overridden(table: Option<&Vec<Option<NonZeroU32>>>, i: usize) -> Option<NonZeroU32> {
    table.and_then(|t| t.get(i).copied().flatten())
}

/// Builds the plan of a request holding `items` (with what they spend besides
/// their classes), from `caller` at `client`, in its box: written where it
/// stays, only the budgets it holds touched (a plan built on the stack and then
/// boxed copied all ~1 KiB of it twice a request, through cache lines the request
/// had not touched yet).
pub(crate) fn plan(
    policy: &Policy,
    scopes: &Scopes,
    (items, reservation): (&Items, Option<&crate::tokens::Reservation>),
    caller: Caller,
    client: &ClientIp,
    route_mode: Enforcement,
) -> Box<Plan> {
    let mut p = Box::write(
        Box::new_uninit(),
        Plan {
            budgets: ArrayVec::new(),
            kinds: ArrayVec::new(),
            windows: ArrayVec::new(),
            top_class: items.held.iter().last().unwrap_or(policy.default_class),
            caller: caller.subject,
            network: client.network,
            who: caller.who,
            from: caller,
            lane: None,
            llm: None,
            price: None,
            reservation: None,
            passed: None,
            run: None,
            shadow: 0,
            shadowed: 0,
        },
    );
    // Every budget of the request is in shadow mode in a dry run or on a shadowed
    // route; else those whose own mode says so.
    let all = policy.dry_run || route_mode == Enforcement::Shadow;
    let shadow = |mode: Enforcement| all || mode == Enforcement::Shadow;
    // The workspace's plan: its limits replace the profile's where it names them,
    // and a plan in shadow mode dry-runs those.
    // (A plan no policy has was refused before planning.)
    let tier = policy.plan_for(&p.from).ok().flatten();
    let tier_shadow = tier.is_some_and(|t| t.mode == Enforcement::Shadow);
    let limit_of = |table: Option<&Vec<Option<NonZeroU32>>>, i: usize, otherwise: NonZeroU32| {
        match overridden(table, i) {
            Some(limit) => (limit, tier_shadow),
            None => (otherwise, false),
        }
    };
    let caller = &p.from;
    let (subject, workspace, user) = (caller.subject, caller.workspace, caller.user);
    let window = policy.window;
    // Each budget's rate from its algorithm (`fixed`: the seed's fixed window).
    let budget = |scope: u64,
                  subject: u64,
                  (limit, window, algorithm): (NonZeroU32, NonZeroU32, Algorithm),
                  cost: u32| Budget {
        key: BudgetKey::from_digests(scope, subject),
        rate: algorithm.rate(window, limit),
        limit: limit.get(),
        cost,
    };
    for class in items.held.iter() {
        let (Some(rule), Some(&scope)) = (
            policy.classes.get(class.index()),
            scopes.classes.get(class.index()),
        ) else {
            continue;
        };
        let (limit, dry) = limit_of(
            tier.map(|t| &t.classes),
            class.index(),
            policy.profile.limit(class),
        );
        p.push(
            budget(
                scope,
                subject,
                (limit, window, rule.algorithm),
                items.count(class),
            ),
            BudgetKind::Class(class),
            window,
            dry || shadow(rule.mode),
        );
    }
    for (i, ceiling) in policy.ceilings.iter().enumerate() {
        let Some(&scope) = scopes.ceilings.get(i) else {
            continue;
        };
        if ceiling.applies(items.held) {
            let (limit, dry) = limit_of(tier.map(|t| &t.ceilings), i, policy.profile.ceiling(i));
            p.push(
                budget(scope, client.subject, (limit, window, ceiling.algorithm), 1),
                BudgetKind::Ceiling(kind_index(i)),
                window,
                dry || shadow(ceiling.mode),
            );
        }
    }
    for (i, units) in items.named_buckets() {
        let (Some(b), Some(&scope)) = (policy.buckets.get(i), scopes.buckets.get(i)) else {
            continue;
        };
        let of = match b.per {
            Per::Ip => client.subject,
            Per::Caller => subject,
            Per::User => user,
            Per::Workspace => workspace,
        };
        let (limit, dry) = limit_of(tier.map(|t| &t.buckets), i, b.limit);
        let mut bucket = budget(scope, of, (limit, b.window, b.algorithm), units);
        if let Some(tokens) = &b.tokens {
            // A token budget reserves what the call is estimated to spend.
            if let Some(r) = reservation {
                bucket.cost = r.units(tokens, &policy.prices);
            }
            if tokens.monthly {
                bucket.rate = Rate::CalendarMonth;
            }
        }
        p.push(
            bucket,
            BudgetKind::Bucket(kind_index(i)),
            b.window,
            dry || shadow(b.mode),
        );
    }
    for (i, &units) in items.quotas.iter().enumerate() {
        let (true, Some(q), Some(&scope)) = (units > 0, policy.quotas.get(i), scopes.quota(i))
        else {
            continue;
        };
        let dry = tier_shadow && overridden(tier.map(|t| &t.quotas), i).is_some();
        let budget = quota_budget(scope, quota_cap(policy, tier, i), workspace, units);
        // A month's length is known only at decision time (see `Plan::window_secs`).
        p.push(
            budget,
            BudgetKind::Quota(kind_index(i)),
            NonZeroU32::MIN,
            dry || shadow(q.mode),
        );
    }
    p
}

impl Plan {
    pub(crate) fn push(
        &mut self,
        budget: Budget,
        kind: BudgetKind,
        window: NonZeroU32,
        shadow: bool,
    ) {
        // Classes, one ceiling, buckets and quotas: the policy validator refuses
        // routes whose requests could touch more than MAX_BUDGETS.
        if self.budgets.is_full() {
            debug_assert!(false, "a plan past MAX_BUDGETS: the policy check missed it");
            return;
        }
        if shadow {
            self.shadow |= 1 << self.budgets.len();
        }
        self.budgets.push(budget);
        self.kinds.push(kind);
        self.windows.push(window.get());
    }

    /// The name of budget `i` in headers and metrics.
    pub fn name<'p>(&self, i: usize, policy: &'p Policy) -> &'p str {
        match self.kinds.get(i) {
            Some(BudgetKind::Class(c)) => policy.class_name(*c),
            Some(BudgetKind::Ceiling(c)) => policy
                .ceilings
                .get(policy_index(*c))
                .map_or("ceiling", |c| c.name.as_str()),
            Some(BudgetKind::Bucket(b)) => policy
                .buckets
                .get(policy_index(*b))
                .map_or("bucket", |b| b.name.as_str()),
            Some(BudgetKind::Quota(q)) => policy
                .quotas
                .get(policy_index(*q))
                .map_or("quota", |q| q.name.as_str()),
            Some(BudgetKind::Turns) => "turns",
            Some(BudgetKind::TurnsTaken) => "turns_taken",
            Some(BudgetKind::RunStarts) => "run_starts",
            None => "",
        }
    }

    /// The window of budget `i` in seconds as decided (a quota's is the length of
    /// the month its reset ends). Whatever the algorithm, the budget allows its
    /// limit per this window: a fixed window's, a sliding window's length, a GCRA
    /// budget's period.
    pub fn window_secs(&self, i: usize, decision: &Decision) -> u64 {
        let monthly = self
            .budgets
            .get(i)
            .is_some_and(|b| b.rate == Rate::CalendarMonth);
        match self.kinds.get(i) {
            _ if monthly => decision.statuses().get(i).map_or(0, |s| {
                let month = month_of(sluice_core::Timestamp::from_secs(s.reset.saturating_sub(1)));
                month.end - month.start
            }),
            _ => self.windows.get(i).copied().map_or(0, u64::from),
        }
    }

    /// The index of the budget `X-RateLimit-*` describe: the refusing one when
    /// refused; when admitted, a weighted budget the request holds, else
    /// the one with the fewest units left among all but monthly quotas.
    pub fn shown_index(&self, decision: &Decision, policy: &Policy) -> usize {
        if !decision.is_admitted() {
            return decision.binding_index();
        }
        // Admitted past a budget in shadow mode: that budget, as its refusal would.
        if let Some(i) = Self::indices(self.shadowed).next() {
            return i;
        }
        if let Some(i) = self.weighted(policy).next() {
            return i;
        }
        let statuses = decision.statuses();
        let mut best: Option<usize> = None;
        for (i, s) in statuses.iter().enumerate() {
            // Neither a monthly quota nor a run's turns is a rate the headers tell.
            if matches!(
                self.kinds.get(i),
                Some(
                    BudgetKind::Quota(_)
                        | BudgetKind::Turns
                        | BudgetKind::TurnsTaken
                        | BudgetKind::RunStarts
                )
            ) {
                continue;
            }
            if best.is_none_or(|b| s.remaining < statuses[b].remaining) {
                best = Some(i);
            }
        }
        best.unwrap_or_else(|| decision.binding_index())
    }

    /// Seconds from the decision until budget `i` has more room, rounded up (the
    /// IETF draft's `t`): for a fixed window or a monthly quota, until it ends (as
    /// `X-RateLimit-Reset`); for a sliding window or GCRA budget, which refill
    /// little by little, until it has room for this request when it refused it
    /// (its own wait, so `Retry-After` is never less), else until it is whole again
    /// (as `X-RateLimit-Reset`).
    pub fn seconds_until_more(&self, i: usize, decision: &Decision) -> u64 {
        let Some(status) = decision.statuses().get(i) else {
            return 0;
        };
        let refills_gradually = matches!(
            self.budgets.get(i).map(|b| b.rate),
            Some(Rate::Gcra { .. } | Rate::RollingWindow { .. } | Rate::SlidingWindow { .. })
        );
        match status.verdict {
            sluice_core::Verdict::NotYet { retry_after } if refills_gradually => {
                retry_after_secs(retry_after)
            }
            _ => status.reset_after_secs(decision.decided_at()),
        }
    }

    /// Indices of the weighted budgets the plan holds.
    pub fn weighted<'a>(&'a self, policy: &'a Policy) -> impl Iterator<Item = usize> + 'a {
        self.kinds.iter().enumerate().filter_map(|(i, k)| match k {
            BudgetKind::Bucket(b)
                if policy
                    .buckets
                    .get(policy_index(*b))
                    .is_some_and(|b| b.weighted) =>
            {
                Some(i)
            }
            _ => None,
        })
    }

    /// True when budget `i` passes an exhausted request on (`on_exhausted: pass`).
    pub fn passes(&self, i: usize, policy: &Policy) -> bool {
        matches!(self.kinds.get(i), Some(BudgetKind::Bucket(b))
            if policy.buckets.get(policy_index(*b)).is_some_and(|b| b.on_exhausted == OnExhausted::Pass))
    }

    /// The budgets in shadow mode that refused `refused`, a bit each by index.
    pub fn shadow_refusals(&self, refused: &Decision) -> u16 {
        self.refusals(refused) & self.shadow
    }

    /// The budgets that refused `refused`, a bit each by index.
    pub fn refusals(&self, refused: &Decision) -> u16 {
        Self::mask(
            refused
                .statuses()
                .iter()
                .enumerate()
                .filter(|(_, s)| s.verdict != sluice_core::Verdict::Admitted)
                .map(|(i, _)| i),
        )
    }

    /// The mask (a bit each) of budget indices.
    pub fn mask(indices: impl IntoIterator<Item = usize>) -> u16 {
        indices
            .into_iter()
            .filter(|&i| i < MAX_BUDGETS)
            .fold(0, |mask, i| mask | 1 << i)
    }

    /// The budgets of `mask` (a bit each by index), in order.
    pub fn indices(mask: u16) -> impl Iterator<Item = usize> {
        (0..MAX_BUDGETS).filter(move |i| mask & (1 << i) != 0)
    }

    /// Why budget `i` of a refusal refused (`sluice_shadow_refusals_total`'s
    /// `reason`, and a refusal's `details.reason`).
    pub fn refusal_reason(&self, i: usize, decision: &Decision) -> &'static str {
        let never = decision
            .statuses()
            .get(i)
            .is_some_and(|s| s.verdict == sluice_core::Verdict::Never);
        match self.kinds.get(i) {
            Some(BudgetKind::Turns) if never => "run_finished",
            Some(BudgetKind::Turns) => "turn_budget_exhausted",
            _ if never => crate::COST_EXCEEDS_LIMIT,
            Some(BudgetKind::Quota(_)) => "quota_exceeded",
            _ => "rate_limited",
        }
    }

    /// True when the plan holds a capped monthly quota (it must be counted in the
    /// shared store, never decided locally).
    pub fn holds_capped_quota(&self, policy: &Policy) -> bool {
        let tier = policy.plan_for(&self.from).ok().flatten();
        self.kinds.iter().any(|k| {
            matches!(k, BudgetKind::Quota(q) if quota_cap(policy, tier, policy_index(*q)).is_some())
        })
    }

    /// How a refusal by budget `i` looks.
    pub fn refusal<'p>(&self, i: usize, policy: &'p Policy) -> &'p Refusal {
        static EDGE: Refusal = Refusal::Edge;
        match self.kinds.get(i) {
            Some(BudgetKind::Bucket(b)) => policy
                .buckets
                .get(policy_index(*b))
                .map_or(&EDGE, |b| &b.refusal),
            _ => &EDGE,
        }
    }
}
