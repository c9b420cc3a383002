//! Reasoning effort as thinking budgets: each API's effort level
//! (`reasoning_effort`, the Responses API's `reasoning.effort`, Anthropic's
//! `output_config.effort`) becomes a cap on a reasoning model's thinking
//! tokens, which the runtime enforces by closing the `<think>` block.
//! `none` switches thinking off instead (the template's own switch).

/// Thinking tokens allowed per effort level (`None`: no cap).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningBudgets(Vec<(String, Option<u32>)>);

impl Default for ReasoningBudgets {
    /// `minimal` 0 (the block closes as it opens), `low` 1,024, `medium`
    /// 4,096, `high` 16,384; `xhigh` and `max` think as long as the model
    /// likes.
    fn default() -> Self {
        let levels = [
            ("minimal", Some(0)),
            ("low", Some(1024)),
            ("medium", Some(4096)),
            ("high", Some(16_384)),
            ("xhigh", None),
            ("max", None),
        ];
        ReasoningBudgets(
            levels
                .into_iter()
                .map(|(name, b)| (name.to_string(), b))
                .collect(),
        )
    }
}

impl ReasoningBudgets {
    /// The defaults with `spec`'s levels set or added: `low=512,high=none`
    /// (a level's tokens, or `none` for no cap). `none` itself cannot be
    /// set: it switches thinking off.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut out = ReasoningBudgets::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, value) = item
                .split_once('=')
                .ok_or_else(|| format!("`{item}`: expected LEVEL=TOKENS or LEVEL=none"))?;
            let name = name.trim();
            if name.is_empty() || name == "none" {
                return Err(format!(
                    "`{item}`: `none` switches thinking off; name another level"
                ));
            }
            let budget = match value.trim() {
                "none" => None,
                n => Some(
                    n.parse::<u32>()
                        .map_err(|_| format!("`{item}`: `{n}` is not a token count or `none`"))?,
                ),
            };
            match out.0.iter_mut().find(|(l, _)| l == name) {
                Some(slot) => slot.1 = budget,
                None => out.0.push((name.to_string(), budget)),
            }
        }
        Ok(out)
    }

    /// The budget of `level` (`Some(None)`: no cap), or `None` when the
    /// level is unknown.
    pub fn get(&self, level: &str) -> Option<Option<u32>> {
        self.0.iter().find(|(l, _)| l == level).map(|(_, b)| *b)
    }

    /// The levels, for error messages: `none, minimal, low, …`.
    pub fn names(&self) -> String {
        let mut names = vec!["none"];
        names.extend(self.0.iter().map(|(l, _)| l.as_str()));
        names.join(", ")
    }
}

/// The level a template that takes one (gpt-oss's `reasoning_effort`:
/// `low`, `medium`, `high`) is told for an API's `level`; none for a level
/// of the server's own naming.
pub(crate) fn template_level(level: &str) -> Option<&'static str> {
    match level {
        "minimal" | "low" => Some("low"),
        "medium" => Some("medium"),
        "high" | "xhigh" | "max" => Some("high"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_set_added_and_checked() {
        let d = ReasoningBudgets::default();
        assert_eq!(d.get("low"), Some(Some(1024)));
        assert_eq!(d.get("max"), Some(None));
        assert_eq!(d.get("extreme"), None);
        let b = ReasoningBudgets::parse(" low=12, high=none,turbo=7 ").unwrap();
        assert_eq!(b.get("low"), Some(Some(12)));
        assert_eq!(b.get("high"), Some(None));
        assert_eq!(b.get("turbo"), Some(Some(7)));
        assert_eq!(b.get("medium"), Some(Some(4096)));
        assert!(b.names().ends_with("max, turbo"), "{}", b.names());
        for bad in ["low", "low=x", "none=5", "=5", "low=-1"] {
            assert!(ReasoningBudgets::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(ReasoningBudgets::parse("").unwrap(), d);
        assert_eq!(template_level("minimal"), Some("low"));
        assert_eq!(template_level("max"), Some("high"));
        assert_eq!(template_level("turbo"), None);
    }
}
