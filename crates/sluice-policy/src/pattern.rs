//! Path patterns of the route table: literal segments, `{name}` for one
//! segment, and a trailing `*` for the rest of the path (zero or more
//! segments).

use std::fmt;

use crate::path::PathCase;

/// One segment of a pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param,
    Rest,
}

/// A parsed path pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathPattern {
    source: String,
    segments: Vec<Segment>,
}

impl PathPattern {
    /// Parses `/a/{id}/b` or `/oauth/*`.
    ///
    /// # Errors
    /// A message saying what is wrong: no leading `/`, an empty `{}`, or a
    /// `*` that is not the last segment.
    pub fn parse(source: &str) -> Result<Self, String> {
        let Some(rest) = source.strip_prefix('/') else {
            return Err(format!("a path pattern starts with '/', got {source:?}"));
        };
        let parts: Vec<&str> = if rest.is_empty() {
            Vec::new()
        } else {
            rest.split('/').collect()
        };
        let mut segments = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            let seg = if *part == "*" {
                if i + 1 != parts.len() {
                    return Err(format!("'*' may only end a pattern, in {source:?}"));
                }
                Segment::Rest
            } else if part.starts_with('{') && part.ends_with('}') {
                if part.len() == 2 {
                    return Err(format!("empty '{{}}' in {source:?}"));
                }
                Segment::Param
            } else if part.contains(['{', '}', '*']) {
                return Err(format!(
                    "a segment is a literal, {{name}} or a final '*', got {part:?} in {source:?}"
                ));
            } else {
                Segment::Literal((*part).to_owned())
            };
            segments.push(seg);
        }
        Ok(PathPattern {
            source: source.to_owned(),
            segments,
        })
    }

    /// True when `path` (without query) matches, its literal segments compared
    /// byte for byte.
    pub fn matches(&self, path: &str) -> bool {
        self.matches_in(path, PathCase::Sensitive)
    }

    /// True when `path` (without query) matches, its literal segments compared as
    /// `case` says.
    pub fn matches_in(&self, path: &str, case: PathCase) -> bool {
        let same = |a: &str, b: &str| match case {
            PathCase::Sensitive => a == b,
            PathCase::Insensitive => a.eq_ignore_ascii_case(b),
        };
        let path = path.strip_prefix('/').unwrap_or(path);
        let path = path.strip_suffix('/').unwrap_or(path);
        let mut parts = (!path.is_empty())
            .then(|| path.split('/'))
            .into_iter()
            .flatten();
        for seg in &self.segments {
            match seg {
                Segment::Rest => return true,
                Segment::Param => match parts.next() {
                    Some(p) if !p.is_empty() => {}
                    _ => return false,
                },
                Segment::Literal(l) => {
                    if !parts.next().is_some_and(|p| same(p, l)) {
                        return false;
                    }
                }
            }
        }
        parts.next().is_none()
    }

    /// The literal segments in ASCII lower case, `{}` for a parameter and `*` for
    /// the rest: two patterns with the same folded form match the same paths when
    /// case is ignored (see `sluice check`'s warning of routes that differ only by
    /// case).
    pub fn folded(&self) -> String {
        let mut out = String::new();
        for seg in &self.segments {
            out.push('/');
            match seg {
                Segment::Literal(l) => out.push_str(&l.to_ascii_lowercase()),
                Segment::Param => out.push_str("{}"),
                Segment::Rest => out.push('*'),
            }
        }
        out
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }
}

impl fmt::Display for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathPattern {
        PathPattern::parse(s).expect("pattern")
    }

    #[test]
    fn literals_params_and_rest() {
        assert!(p("/chats").matches("/chats"));
        assert!(p("/chats").matches("/chats/"));
        assert!(!p("/chats").matches("/chats/1"));
        assert!(p("/routines/{id}/run").matches("/routines/42/run"));
        assert!(!p("/routines/{id}/run").matches("/routines//run"));
        assert!(!p("/routines/{id}/run").matches("/routines/42"));
        assert!(p("/oauth/*").matches("/oauth/register"));
        assert!(p("/oauth/*").matches("/oauth/a/b"));
        assert!(p("/oauth/*").matches("/oauth"));
        assert!(!p("/oauth/*").matches("/oauthx"));
        assert!(!p("/chats").matches("/CHATS"));
        assert!(p("/chats").matches_in("/CHATS", PathCase::Insensitive));
        assert!(p("/routines/{id}/Run").matches_in("/ROUTINES/Ab/run", PathCase::Insensitive));
        assert!(!p("/routines/{id}/Run").matches_in("/routines/ab/run", PathCase::Sensitive));
        assert_eq!(
            p("/Routines/{id}/*").folded(),
            p("/routines/{x}/*").folded()
        );
        assert!(p("/").matches("/"));
        assert!(!p("/").matches("/x"));
    }

    #[test]
    fn bad_patterns_are_errors() {
        assert!(PathPattern::parse("chats").is_err());
        assert!(PathPattern::parse("/a/*/b").is_err());
        assert!(PathPattern::parse("/a/{}").is_err());
        assert!(PathPattern::parse("/a/b*").is_err());
    }
}
