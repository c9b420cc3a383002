//! What the chat crate's tests share: a stream read whole must read the
//! same however it is cut.

use std::fmt::Debug;

/// A fixed xorshift stream: the same numbers every run.
pub(crate) struct Xorshift(pub(crate) u64);

impl Xorshift {
    /// The next number below `n`.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// `text`'s characters, each its own piece.
fn by_characters(text: &str) -> Vec<&str> {
    text.char_indices()
        .map(|(at, c)| &text[at..at + c.len_utf8()])
        .collect()
}

/// Asserts that `read` gives for `text` cut in two at every character
/// boundary, and a character at a time, what it gives for it whole;
/// returns that.
pub(crate) fn read_alike_at_every_cut<T: PartialEq + Debug>(
    text: &str,
    read: impl Fn(&[&str]) -> T,
) -> T {
    let whole = read(&[text]);
    for cut in (0..=text.len()).filter(|&c| text.is_char_boundary(c)) {
        assert_eq!(
            read(&[&text[..cut], &text[cut..]]),
            whole,
            "{text:?} cut at {cut}"
        );
    }
    assert_eq!(read(&by_characters(text)), whole, "{text:?} by characters");
    whole
}

/// Asserts that `read` gives for `text` a character at a time, and cut in
/// three at two character boundaries `rng` picks, what it gives for it
/// whole; returns that.
pub(crate) fn read_alike_cut_at_random<T: PartialEq + Debug>(
    text: &str,
    rng: &mut Xorshift,
    read: impl Fn(&[&str]) -> T,
) -> T {
    let whole = read(&[text]);
    assert_eq!(read(&by_characters(text)), whole, "{text:?} by characters");
    let bounds: Vec<usize> = (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    let (mut a, mut b) = (
        bounds[rng.below(bounds.len())],
        bounds[rng.below(bounds.len())],
    );
    if a > b {
        std::mem::swap(&mut a, &mut b);
    }
    let cut = [&text[..a], &text[a..b], &text[b..]];
    assert_eq!(read(&cut), whole, "{text:?} at {a},{b}");
    whole
}
