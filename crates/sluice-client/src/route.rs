//! Where one request goes and which budgets it spends: a key of its
//! provider ([`Route`]) and, on that key, the key-wide budgets and those of
//! the request's model group ([`Scope`]s), each with token axes counted
//! apart ([`TokenAxis`]).

use crate::config::{ProviderConfig, ProviderLimits};

/// A token window: all tokens (TPM), input only (ITPM) or output only (OTPM).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum TokenAxis {
    /// Input and output together.
    Total,
    /// Input (the prompt).
    Input,
    /// Output (the completion budget, then what was generated).
    Output,
}

impl TokenAxis {
    pub(crate) const ALL: [TokenAxis; 3] = [TokenAxis::Total, TokenAxis::Input, TokenAxis::Output];

    /// This axis's limit in `l` (0 = unlimited).
    pub(crate) fn limit(self, l: &ProviderLimits) -> u32 {
        match self {
            TokenAxis::Total => l.tpm,
            TokenAxis::Input => l.itpm,
            TokenAxis::Output => l.otpm,
        }
    }
}

/// Tokens a request reserves or used, input and output apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Cost {
    pub(crate) input: u32,
    pub(crate) output: u32,
}

impl Cost {
    pub(crate) fn total(self) -> u32 {
        self.input.saturating_add(self.output)
    }

    /// What this cost spends on `axis`.
    pub(crate) fn on(self, axis: TokenAxis) -> u32 {
        match axis {
            TokenAxis::Total => self.total(),
            TokenAxis::Input => self.input,
            TokenAxis::Output => self.output,
        }
    }
}

/// One set of budgets: a key's provider-wide limits, or a model group's
/// limits on that key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Scope {
    /// Names the books (a digest: no key is stored).
    pub(crate) subject: u64,
    pub(crate) limits: ProviderLimits,
}

impl Scope {
    /// The token axes this scope limits and `cost` spends: (axis, limit).
    pub(crate) fn token_axes(&self, cost: Cost) -> impl Iterator<Item = (TokenAxis, u32)> + '_ {
        TokenAxis::ALL.into_iter().filter_map(move |a| {
            let limit = a.limit(&self.limits);
            (limit > 0 && cost.on(a) > 0).then_some((a, limit))
        })
    }

    /// The largest total of tokens `cost` may shrink to (only the input
    /// shrinks) and still fit under this scope's whole limits (a whole
    /// minute's, a whole day's). A completion budget above the OTPM never
    /// fits: the room is then the OTPM, below the request's total.
    pub(crate) fn total_room(&self, cost: Cost) -> u32 {
        let l = &self.limits;
        let mut room = u32::MAX;
        if l.tpm > 0 {
            room = room.min(l.tpm);
        }
        if l.itpm > 0 {
            room = room.min(l.itpm.saturating_add(cost.output));
        }
        if l.otpm > 0 && cost.output > l.otpm {
            room = room.min(l.otpm);
        }
        if l.tpd > 0 {
            room = room.min(l.tpd);
        }
        room
    }
}

/// One way to send a request: a key and the scopes it spends there
/// (the key-wide scope first, then the model group's, if any).
#[derive(Clone, Debug)]
pub(crate) struct Route {
    /// The key's name (`apiKeys`), if the provider has several.
    pub(crate) key_name: Option<String>,
    /// The key to send, if the route chooses it.
    pub(crate) secret: Option<String>,
    pub(crate) scopes: Vec<Scope>,
}

impl Route {
    /// The narrowest scope: the model group's, else the key's. A 429 or
    /// headers on an answer describe it.
    pub(crate) fn narrow(&self) -> &Scope {
        // Every route has its key scope.
        &self.scopes[self.scopes.len() - 1]
    }
}

/// The budgets of `p` on its single key: same provider and key → same
/// books in every process (the key is hashed, never stored).
pub(crate) fn provider_subject(p: &ProviderConfig) -> u64 {
    let mut s = Vec::with_capacity(64);
    s.extend_from_slice(p.name.as_bytes());
    s.push(0);
    match &p.api_key {
        Some(k) => s.extend_from_slice(k.as_bytes()),
        None => s.extend_from_slice(p.base_url.as_bytes()),
    }
    sluice_core::digest(&s)
}

fn key_subject(p: &ProviderConfig, secret: &str) -> u64 {
    let mut s = Vec::with_capacity(64);
    s.extend_from_slice(p.name.as_bytes());
    s.extend_from_slice(b"\0key\0");
    s.extend_from_slice(secret.as_bytes());
    sluice_core::digest(&s)
}

fn group_subject(key: u64, group: &str) -> u64 {
    let mut s = Vec::with_capacity(32 + group.len());
    s.extend_from_slice(&key.to_le_bytes());
    s.extend_from_slice(b"\0model\0");
    s.extend_from_slice(group.as_bytes());
    sluice_core::digest(&s)
}

/// The model group a request for `model` spends (`None`: the request names
/// no model, or none of `p`'s `models:` covers it; it goes by the
/// provider-wide limits alone).
pub(crate) fn group_of<'p>(p: &'p ProviderConfig, model: Option<&str>) -> Option<&'p str> {
    model
        .and_then(|m| p.model(m))
        .map(|entry| entry.group.as_str())
}

/// Every way to send a request for `group` to `p`: one route per key.
pub(crate) fn routes(p: &ProviderConfig, group: Option<&str>) -> Vec<Route> {
    let model_limits = group.and_then(|g| p.models.iter().find(|m| m.group == g));
    let with_model = |key: u64, limits: ProviderLimits| {
        let mut scopes = vec![Scope {
            subject: key,
            limits,
        }];
        if let Some(m) = model_limits {
            scopes.push(Scope {
                subject: group_subject(key, &m.group),
                limits: m.limits,
            });
        }
        scopes
    };
    if p.api_keys.is_empty() {
        return vec![Route {
            key_name: None,
            secret: None,
            scopes: with_model(provider_subject(p), p.limits),
        }];
    }
    p.api_keys
        .iter()
        .map(|k| Route {
            key_name: Some(k.name.clone()),
            secret: Some(k.secret.clone()),
            scopes: with_model(key_subject(p, &k.secret), k.limits),
        })
        .collect()
}
