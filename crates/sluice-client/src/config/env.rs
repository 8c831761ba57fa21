//! `${ENV}` substitution in config strings.
//!
//! `${NAME}` is replaced by the variable's value, `${NAME:-fallback}` by the
//! fallback when the variable is unset or empty, and `$$` by a literal `$`.
//! A missing variable is an error that names the variable and the key path.

/// Why a string could not be substituted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum EnvProblem {
    /// `${NAME}` with `NAME` unset and no fallback.
    Missing(String),
    /// `${` with no closing `}`, or an empty or malformed name.
    Malformed(String),
}

impl EnvProblem {
    pub(crate) fn message(&self) -> String {
        match self {
            EnvProblem::Missing(var) => format!(
                "environment variable {var} is not set (write ${{{var}:-fallback}} for a default)"
            ),
            EnvProblem::Malformed(why) => why.clone(),
        }
    }
}

/// Substitutes `${…}` in `value`, looking variables up with `lookup`.
pub(crate) fn substitute(
    value: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<String, EnvProblem> {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(body) = after.strip_prefix('{') {
            // Neither message quotes the value: a placeholder typed around a
            // key (`${sk-…}`) would show the key in the error, `/status` and logs.
            let Some(end) = body.find('}') else {
                return Err(EnvProblem::Malformed(
                    "`${` without a closing `}`".to_owned(),
                ));
            };
            let inner = &body[..end];
            let (name, fallback) = match inner.split_once(":-") {
                Some((n, f)) => (n, Some(f)),
                None => (inner, None),
            };
            let valid = !name.is_empty()
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !name.starts_with(|c: char| c.is_ascii_digit());
            if !valid {
                return Err(EnvProblem::Malformed(
                    "`${…}` does not hold a variable name (letters, digits, `_`, not starting with a digit)"
                        .to_owned(),
                ));
            }
            match (lookup(name).filter(|v| !v.is_empty()), fallback) {
                (Some(v), _) => out.push_str(&v),
                (None, Some(f)) => out.push_str(f),
                (None, None) => return Err(EnvProblem::Missing(name.to_owned())),
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "KEY" => Some("sk-123".into()),
            "EMPTY" => Some(String::new()),
            _ => None,
        }
    }

    #[test]
    fn replaces_variables_fallbacks_and_dollars() {
        assert_eq!(substitute("${KEY}", &env).unwrap(), "sk-123");
        assert_eq!(substitute("a-${KEY}-b", &env).unwrap(), "a-sk-123-b");
        assert_eq!(substitute("${NOPE:-x}", &env).unwrap(), "x");
        assert_eq!(substitute("${EMPTY:-y}", &env).unwrap(), "y");
        assert_eq!(substitute("$$5 $ ok", &env).unwrap(), "$5 $ ok");
        assert_eq!(substitute("plain", &env).unwrap(), "plain");
    }

    #[test]
    fn missing_and_malformed_are_errors() {
        assert_eq!(
            substitute("${NOPE}", &env),
            Err(EnvProblem::Missing("NOPE".into()))
        );
        assert!(matches!(
            substitute("${KEY", &env),
            Err(EnvProblem::Malformed(_))
        ));
        assert!(matches!(
            substitute("${1A}", &env),
            Err(EnvProblem::Malformed(_))
        ));
        assert!(
            EnvProblem::Missing("OPENAI_API_KEY".into())
                .message()
                .contains("OPENAI_API_KEY")
        );
    }

    /// C1, and no leaked key: a key typed inside `${…}` (or with its `}`
    /// missing) is refused without the error, `/status` or a log line quoting it.
    #[test]
    fn a_malformed_placeholder_never_quotes_the_value() {
        for value in [
            "${sk-proj-SECRET123}",
            "${sk-proj-SECRET123",
            "Bearer ${sk-SECRET123}",
        ] {
            let Err(problem) = substitute(value, &env) else {
                panic!("{value} is malformed");
            };
            assert!(
                !problem.message().contains("SECRET123"),
                "{}",
                problem.message()
            );
        }
    }
}
