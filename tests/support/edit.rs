//! Edits of a policy's YAML in tests that fail when the text to edit is not there: a
//! test edits the built-in policy to set up its case, and an edit that silently does
//! nothing (because the built-in policy changed) would test the wrong thing.

/// `replace` that insists on finding what it replaces.
pub(crate) trait Edit {
    /// The text with every `from` replaced by `to`.
    ///
    /// # Panics
    /// When the text does not hold `from`.
    fn edit(&self, from: &str, to: &str) -> String;
}

impl Edit for str {
    #[track_caller]
    fn edit(&self, from: &str, to: &str) -> String {
        assert!(
            self.contains(from),
            "the policy no longer holds `{from}`: update the test that edits it"
        );
        self.replace(from, to)
    }
}
