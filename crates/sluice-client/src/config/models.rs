//! `models:` under a provider: model names and `*` patterns with their own
//! limits, grouped into shared budgets (`shared: name`), and the check that
//! no model falls under two patterns with different limits.

use super::limits::ProviderLimits;

/// One `models:` entry, checked: the model names it covers and the budget
/// they spend.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ModelLimits {
    /// A model name (`gpt-4o-mini`) or a pattern where `*` stands for any
    /// run of characters (`gpt-4o*`).
    pub pattern: String,
    /// The budget's name: the entry's `shared:` group, else its pattern.
    /// Entries of one group spend one budget.
    pub group: String,
    /// The group's limits; 0 on an axis means no model limit there (the
    /// provider-wide limits still apply).
    pub limits: ProviderLimits,
}

impl ModelLimits {
    /// An entry for `pattern` with its own budget of `limits`.
    pub fn new(pattern: &str, limits: ProviderLimits) -> Self {
        ModelLimits {
            pattern: pattern.to_owned(),
            group: pattern.to_owned(),
            limits,
        }
    }

    /// The same entry spending the budget of `group` instead.
    #[must_use]
    pub fn shared(mut self, group: &str) -> Self {
        self.group = group.to_owned();
        self
    }

    /// Whether `model` is covered by this entry.
    pub fn matches(&self, model: &str) -> bool {
        glob_matches(&self.pattern, model)
    }

    fn is_pattern(&self) -> bool {
        self.pattern.contains('*')
    }
}

/// The entry governing `model`: an exact name first, then the pattern with
/// the most literal characters (then the first in name order).
pub fn model_entry<'m>(models: &'m [ModelLimits], model: &str) -> Option<&'m ModelLimits> {
    models
        .iter()
        .find(|m| !m.is_pattern() && m.pattern == model)
        .or_else(|| {
            models
                .iter()
                .filter(|m| m.is_pattern() && m.matches(model))
                .max_by(|a, b| {
                    literal_len(&a.pattern)
                        .cmp(&literal_len(&b.pattern))
                        .then_with(|| b.pattern.cmp(&a.pattern))
                })
        })
}

fn literal_len(p: &str) -> usize {
    p.chars().filter(|&c| c != '*').count()
}

/// Whether `text` matches `pattern`, where `*` matches any run of
/// characters (none included). Linear in the text; no recursion.
pub fn glob_matches(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut i, mut j) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while j < t.len() {
        if i < p.len() && p[i] != '*' && p[i] == t[j] {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some((i, j));
            i += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

/// Whether some model name matches both patterns (each may hold `*`): a
/// search over pairs of positions, one in each pattern, bounded by the
/// product of their lengths.
pub fn globs_overlap(a: &str, b: &str) -> bool {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // State (i, j): positions reached in a and b after reading the same
    // text. A `*` may be passed over without reading; a character read
    // moves a literal forward, and a `*` stays.
    let mut seen = vec![false; (a.len() + 1) * (b.len() + 1)];
    let mut stack = vec![(0usize, 0usize)];
    let idx = |i: usize, j: usize| i * (b.len() + 1) + j;
    while let Some((i, j)) = stack.pop() {
        if seen[idx(i, j)] {
            continue;
        }
        seen[idx(i, j)] = true;
        if i == a.len() && j == b.len() {
            return true;
        }
        let mut push = |i: usize, j: usize| {
            if !seen[idx(i, j)] {
                stack.push((i, j));
            }
        };
        if i < a.len() && a[i] == '*' {
            push(i + 1, j);
        }
        if j < b.len() && b[j] == '*' {
            push(i, j + 1);
        }
        // Read one character both can take.
        match (a.get(i), b.get(j)) {
            (Some('*'), Some('*')) => push(i, j),
            (Some('*'), Some(_)) => push(i, j + 1),
            (Some(_), Some('*')) => push(i + 1, j),
            (Some(x), Some(y)) if x == y => push(i + 1, j + 1),
            _ => {}
        }
    }
    false
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn m1_patterns_match_names() {
        assert!(glob_matches("gpt-4o*", "gpt-4o"));
        assert!(glob_matches("gpt-4o*", "gpt-4o-mini-2024"));
        assert!(glob_matches("*mini*", "gpt-4o-mini"));
        assert!(glob_matches("claude-*-sonnet*", "claude-3-5-sonnet-latest"));
        assert!(!glob_matches("gpt-4o*", "gpt-4"));
        assert!(!glob_matches("gpt-4o", "gpt-4o-mini"));
        assert!(glob_matches("*", ""));
    }

    #[test]
    fn m1_overlapping_patterns_are_found() {
        assert!(globs_overlap("gpt-4o*", "gpt-4o-mini"));
        assert!(globs_overlap("gpt-4o*", "*mini"));
        assert!(globs_overlap("a*b", "*"));
        assert!(!globs_overlap("gpt-4o*", "claude*"));
        assert!(!globs_overlap("gpt-4o", "gpt-4o-mini"));
        assert!(!globs_overlap("a*b", "a*c"));
        assert!(globs_overlap("a*c*", "*b*"));
    }

    #[test]
    fn m1_an_exact_name_wins_then_the_most_specific_pattern() {
        let l = ProviderLimits::new(1, 1, 0);
        let models = [
            ModelLimits::new("gpt-4o*", l),
            ModelLimits::new("gpt-4o-mini*", l),
            ModelLimits::new("gpt-4o-mini", l),
        ];
        let of = |m: &str| model_entry(&models, m).map(|e| e.pattern.as_str());
        assert_eq!(of("gpt-4o-mini"), Some("gpt-4o-mini"));
        assert_eq!(of("gpt-4o-mini-2024"), Some("gpt-4o-mini*"));
        assert_eq!(of("gpt-4o"), Some("gpt-4o*"));
        assert_eq!(of("o1"), None);
    }
}
