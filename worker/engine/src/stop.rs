//! Stop strings, matched incrementally: each stop string carries its own
//! Knuth-Morris-Pratt state from token to token, so each new byte costs
//! amortized O(1) per stop string, whatever their length, and building the
//! matcher costs one pass over them. A request with the most and longest
//! stop strings allowed cannot slow the engine's thread for other requests.
//!
//! A match ends at the first byte that completes any stop string; among
//! those ending there, the longest wins (it starts earliest). This depends
//! only on the text, never on how it was split into tokens.

/// One request's stop strings, each with its failure table.
#[derive(Debug, Clone, Default)]
pub(crate) struct StopStrings {
    patterns: Vec<Pattern>,
}

#[derive(Debug, Clone)]
struct Pattern {
    text: String,
    /// `fail[k]`: the longest proper prefix of `text[..=k]` that is also
    /// its suffix (the KMP prefix function).
    fail: Vec<u16>,
}

/// Where a sequence is: for each stop string, how many of its first bytes
/// the text ends with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct StopState(Vec<u16>);

/// A stop string found in the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StopMatch {
    /// Where it starts in the fed text: the text is cut here.
    pub start: usize,
    pub stop: String,
}

impl StopStrings {
    /// Empty stop strings never match (requests refuse them anyway).
    pub fn new(patterns: &[String]) -> StopStrings {
        let patterns = patterns
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| {
                let b = p.as_bytes();
                let mut fail = vec![0u16; b.len()];
                let mut k = 0usize;
                for i in 1..b.len() {
                    while k > 0 && b[i] != b[k] {
                        k = usize::from(fail[k - 1]);
                    }
                    if b[i] == b[k] {
                        k += 1;
                    }
                    fail[i] = k as u16;
                }
                Pattern {
                    text: p.clone(),
                    fail,
                }
            })
            .collect();
        StopStrings { patterns }
    }

    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// Feeds `text[from..]`, the text's new bytes, and returns the first
    /// stop string they complete.
    pub fn feed(&self, state: &mut StopState, text: &str, from: usize) -> Option<StopMatch> {
        if self.is_empty() {
            return None;
        }
        state.0.resize(self.patterns.len(), 0);
        for (i, &c) in text.as_bytes()[from..].iter().enumerate() {
            let mut found: Option<&Pattern> = None;
            for (p, k) in self.patterns.iter().zip(state.0.iter_mut()) {
                let b = p.text.as_bytes();
                let mut at = usize::from(*k);
                while at > 0 && b[at] != c {
                    at = usize::from(p.fail[at - 1]);
                }
                if b[at] == c {
                    at += 1;
                }
                if at == b.len() {
                    if found.is_none_or(|f| f.text.len() < b.len()) {
                        found = Some(p);
                    }
                    at = usize::from(p.fail[at - 1]);
                }
                *k = at as u16;
            }
            if let Some(p) = found {
                let end = from + i + 1;
                return Some(StopMatch {
                    start: end - p.text.len(),
                    stop: p.text.clone(),
                });
            }
        }
        None
    }

    /// Bytes at the end of the text that may yet become a stop string, and
    /// so are held back from the client.
    pub fn held(&self, state: &StopState) -> usize {
        state.0.iter().copied().max().map_or(0, usize::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The definition: the first end position at which some stop string
    /// ends, and of those the longest.
    fn naive(text: &str, stops: &[String]) -> Option<StopMatch> {
        for end in 1..=text.len() {
            let best = stops
                .iter()
                .filter(|s| !s.is_empty() && text.as_bytes()[..end].ends_with(s.as_bytes()))
                .max_by_key(|s| s.len());
            if let Some(s) = best {
                return Some(StopMatch {
                    start: end - s.len(),
                    stop: s.clone(),
                });
            }
        }
        None
    }

    /// The longest suffix of `text` that is a proper prefix of a stop.
    fn naive_held(text: &str, stops: &[String]) -> usize {
        stops
            .iter()
            .flat_map(|s| (1..s.len()).filter(|&k| text.as_bytes().ends_with(&s.as_bytes()[..k])))
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn finds_the_first_ending_and_the_longest_there() {
        let stops = ["abcd", "bc", "xbc"].map(String::from);
        let m = StopStrings::new(&stops);
        let mut st = StopState::default();
        let found = m.feed(&mut st, "zzxbcd", 0).unwrap();
        assert_eq!((found.start, found.stop.as_str()), (2, "xbc"));
        // Split anywhere, the answer is the same.
        let text = "zzxbcd";
        for cut in 0..text.len() {
            let mut st = StopState::default();
            let first = m.feed(&mut st, &text[..cut], 0);
            let found = first.or_else(|| m.feed(&mut st, text, cut)).unwrap();
            assert_eq!(found.start, 2, "cut at {cut}");
        }
    }

    #[test]
    fn holds_back_a_partial_stop_string() {
        let stops = ["</end>".to_owned()];
        let m = StopStrings::new(&stops);
        let mut st = StopState::default();
        assert_eq!(m.feed(&mut st, "hello </e", 0), None);
        assert_eq!(m.held(&st), "</e".len());
        assert_eq!(m.feed(&mut st, "hello </ex", 9), None);
        assert_eq!(m.held(&st), 0);
    }

    proptest! {
        #[test]
        fn matches_the_definition_fed_in_any_pieces(
            stops in proptest::collection::vec("[ab]{1,4}", 1..5),
            text in "[abc]{0,40}",
            cuts in proptest::collection::vec(0usize..40, 0..6),
        ) {
            let m = StopStrings::new(&stops);
            let mut cuts: Vec<usize> = cuts.into_iter().filter(|&c| c < text.len()).collect();
            cuts.push(text.len());
            cuts.sort_unstable();
            let mut st = StopState::default();
            let (mut from, mut found) = (0, None);
            for cut in cuts {
                if found.is_none() {
                    found = m.feed(&mut st, &text[..cut], from);
                    if found.is_none() {
                        prop_assert_eq!(m.held(&st), naive_held(&text[..cut], &stops));
                    }
                }
                from = cut;
            }
            prop_assert_eq!(found, naive(&text, &stops));
        }
    }
}
