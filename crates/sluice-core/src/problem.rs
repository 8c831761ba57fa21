//! One thing wrong with a configuration file, at a key path: what a policy file and a
//! pace config both report, the same way.

use std::fmt;

/// One thing wrong with a configuration file, at a key path such as
/// `routes[3].class` (a policy) or `providers.openai.rateLimits.tpm` (a pace config).
/// It reads `path: message`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Where in the file.
    pub path: String,
    /// What was expected.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_reads_path_then_message() {
        let problem = Problem {
            path: "routes[3].class".to_owned(),
            message: "expected one of protocol, read, standard, expensive".to_owned(),
        };
        assert_eq!(
            problem.to_string(),
            "routes[3].class: expected one of protocol, read, standard, expensive"
        );
    }
}
