//! Stop strings matched across token boundaries.

/// What [`StopMatcher::push`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// No stop string yet; this text is safe to emit.
    Continue(String),
    /// A stop string matched; emit this text (what came before it) and stop.
    Stopped(String),
}

/// The length of the longest tail of `text` that is a proper prefix of
/// `marker`: what a stream must hold back, as the next text may complete the
/// marker (stop strings, tool-call and thinking tags).
pub fn held_prefix_len(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .filter(|&n| marker.is_char_boundary(n))
        .find(|&n| text.ends_with(&marker[..n]))
        .unwrap_or(0)
}

/// Watches generated text for stop strings. Text that might be the start of a
/// stop string is held back until it is either completed (and dropped) or
/// proven harmless (and released).
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    /// The stop string that matched.
    matched: Option<String>,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
            matched: None,
        }
    }

    /// The stop string that ended the text, once one has (the one found
    /// first in the text; of two found at one place, the first given).
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Adds newly generated text.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Continue(text.to_owned());
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = first {
            self.matched = Some(stop.clone());
            let out = self.held[..at].to_owned();
            self.held.clear();
            return StopOutcome::Stopped(out);
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .map(|s| held_prefix_len(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_owned();
        self.held.drain(..cut);
        StopOutcome::Continue(out)
    }

    /// The generation ended for another reason: release what was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Continue(t) => out += &t,
                StopOutcome::Stopped(t) => return (out + &t, true),
            }
        }
        (out + &m.finish(), false)
    }

    #[test]
    fn table() {
        let check = |stops: &[&str], pieces: &[&str], expected: (&str, bool)| {
            assert_eq!(
                run(stops, pieces),
                (expected.0.to_owned(), expected.1),
                "{stops:?} {pieces:?}"
            );
        };
        check(&[], &["a", "b"], ("ab", false));
        check(&["END"], &["foo E", "N", "D bar"], ("foo ", true));
        check(&["END"], &["foo EN", "x"], ("foo ENx", false));
        check(&["END"], &["foo EN"], ("foo EN", false));
        check(&["\n\n", "###"], &["a\n", "#", "\nb"], ("a\n#\nb", false));
        check(&["\n\n", "###"], &["a\n", "\nb"], ("a", true));
        check(&["世界"], &["你好世", "界!"], ("你好", true));
        check(&["ab", "b"], &["xab"], ("x", true));
    }

    #[test]
    fn nothing_that_could_start_a_stop_is_emitted_early() {
        let stops = vec!["<|end|>".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("hi <|"), StopOutcome::Continue("hi ".into()));
        assert_eq!(m.push("en"), StopOutcome::Continue(String::new()));
        assert_eq!(m.push("d|>tail"), StopOutcome::Stopped(String::new()));
    }
}

#[cfg(test)]
mod matched_tests {
    use super::*;

    /// The stop string reported is the one found first in the text.
    #[test]
    fn the_first_stop_found_is_the_one_matched() {
        let mut m = StopMatcher::new(&["END".to_string(), "x".to_string()]);
        assert_eq!(m.push("abc E"), StopOutcome::Continue("abc ".into()));
        assert_eq!(m.matched(), None);
        assert_eq!(m.push("NDx"), StopOutcome::Stopped("".into()));
        assert_eq!(m.matched(), Some("END"));
        let mut m = StopMatcher::new(&["END".to_string(), "x".to_string()]);
        assert_eq!(m.push("a x END"), StopOutcome::Stopped("a ".into()));
        assert_eq!(m.matched(), Some("x"));
    }
}
