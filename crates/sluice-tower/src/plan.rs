//! From a classified request to the budgets it spends: its class budgets,
//! one IP ceiling and any route buckets, decided together (SPEC E1–E7).

use std::num::NonZeroU32;

use arrayvec::ArrayVec;
use sluice_core::{Budget, BudgetKey, MAX_BUDGETS, Rate, digest};
use sluice_policy::{Caller, Class, ClientIp, Items, Per, Policy, Refusal};

/// What a budget of a plan is, for headers, refusals and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BudgetKind {
    /// The caller's budget of a class.
    Class(Class),
    /// The per-IP ceiling for requests holding work.
    IpWork,
    /// The per-IP ceiling for protocol-only requests.
    IpProtocol,
    /// A route bucket (index into the policy's buckets).
    Bucket(usize),
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
    /// The most costly class the request holds (for metrics).
    pub top_class: Class,
    /// The caller's subject digest.
    pub caller: u64,
    /// The caller as logs and the status page show it.
    pub who: sluice_policy::Who,
}

/// Digests of every scope name, computed once per policy.
#[derive(Clone, Debug)]
pub struct Scopes {
    classes: [u64; 4],
    ip_work: u64,
    ip_protocol: u64,
    buckets: Vec<u64>,
}

impl Scopes {
    /// The scopes of `policy`.
    pub fn new(policy: &Policy) -> Self {
        Scopes {
            classes: Class::ALL.map(|c| digest(format!("class:{}", c.name()).as_bytes())),
            ip_work: digest(b"ip:work"),
            ip_protocol: digest(b"ip:protocol_only"),
            buckets: policy
                .buckets
                .iter()
                .map(|b| digest(format!("bucket:{}", b.name).as_bytes()))
                .collect(),
        }
    }
}

/// Builds the plan of a request holding `items`, from `caller` at `client`,
/// spending the route buckets `buckets`.
pub(crate) fn plan(
    policy: &Policy,
    scopes: &Scopes,
    items: &Items,
    caller: &Caller,
    client: &ClientIp,
    buckets: &[usize],
) -> Plan {
    let mut p = Plan {
        budgets: ArrayVec::new(),
        kinds: ArrayVec::new(),
        windows: ArrayVec::new(),
        top_class: Class::ALL
            .into_iter()
            .rev()
            .find(|&c| items.count(c) > 0)
            .unwrap_or(policy.default_class),
        caller: caller.subject,
        who: caller.who,
    };
    let window = policy.window;
    let fixed =
        |scope: u64, subject: u64, limit: NonZeroU32, window: NonZeroU32, cost: u32| Budget {
            key: BudgetKey::from_digests(scope, subject),
            rate: Rate::FixedWindow { seconds: window },
            limit: limit.get(),
            cost,
        };
    for class in Class::ALL {
        let n = items.count(class);
        if n > 0 {
            p.push(
                fixed(
                    scopes.classes[class.index()],
                    caller.subject,
                    policy.profile.limit(class),
                    window,
                    n,
                ),
                BudgetKind::Class(class),
                window,
            );
        }
    }
    if items.protocol_only() {
        let limit = policy.profile.ceiling_protocol_only;
        p.push(
            fixed(scopes.ip_protocol, client.subject, limit, window, 1),
            BudgetKind::IpProtocol,
            window,
        );
    } else {
        let limit = policy.profile.ceiling_work;
        p.push(
            fixed(scopes.ip_work, client.subject, limit, window, 1),
            BudgetKind::IpWork,
            window,
        );
    }
    for &i in buckets {
        let (Some(b), Some(&scope)) = (policy.buckets.get(i), scopes.buckets.get(i)) else {
            continue;
        };
        let subject = match b.per {
            Per::Ip => client.subject,
            Per::Caller => caller.subject,
            Per::User => caller.user,
            Per::Workspace => caller.workspace,
        };
        p.push(
            fixed(scope, subject, b.limit, b.window, 1),
            BudgetKind::Bucket(i),
            b.window,
        );
    }
    p
}

impl Plan {
    fn push(&mut self, budget: Budget, kind: BudgetKind, window: NonZeroU32) {
        // Four classes, one ceiling and the buckets: past MAX_BUDGETS the
        // policy validator refuses routes with too many buckets.
        if self.budgets.is_full() {
            return;
        }
        self.budgets.push(budget);
        self.kinds.push(kind);
        self.windows.push(window.get());
    }

    /// The name of budget `i` in headers and metrics.
    pub fn name<'p>(&self, i: usize, policy: &'p Policy) -> &'p str {
        match self.kinds.get(i) {
            Some(BudgetKind::Class(c)) => c.name(),
            Some(BudgetKind::IpWork) => "ip",
            Some(BudgetKind::IpProtocol) => "ip_protocol",
            Some(BudgetKind::Bucket(b)) => {
                policy.buckets.get(*b).map_or("bucket", |b| b.name.as_str())
            }
            None => "",
        }
    }

    /// How a refusal by budget `i` looks.
    pub fn refusal<'p>(&self, i: usize, policy: &'p Policy) -> &'p Refusal {
        static EDGE: Refusal = Refusal::Edge;
        match self.kinds.get(i) {
            Some(BudgetKind::Bucket(b)) => policy.buckets.get(*b).map_or(&EDGE, |b| &b.refusal),
            _ => &EDGE,
        }
    }
}
