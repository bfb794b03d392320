//! Looking up the engine's maps keyed by `(pipeline, stored key)` without building a key.
//!
//! The batch's states and Sparkplug entries are `BTreeMap<(String, Vec<u8>), _>`. A lookup
//! through `get(&(name.to_string(), skey.to_vec()))` allocated both parts and freed them
//! again: at 16 pipelines, three such lookups per record and pipeline, each allocation
//! taking the loop's allocator lock (issue 33). [`at`] looks up with the borrowed parts:
//! the owned key borrows as a [`StateKey`] trait object, which both forms implement, and
//! which orders exactly as the owned tuple does (by name, then by the key's bytes).

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::collections::BTreeMap;

/// A (pipeline, stored key) pair, owned or borrowed.
pub(crate) trait StateKey {
    fn parts(&self) -> (&str, &[u8]);
}

impl StateKey for (String, Vec<u8>) {
    fn parts(&self) -> (&str, &[u8]) {
        (&self.0, &self.1)
    }
}

impl StateKey for (&str, &[u8]) {
    fn parts(&self) -> (&str, &[u8]) {
        (self.0, self.1)
    }
}

impl<'a> Borrow<dyn StateKey + 'a> for (String, Vec<u8>) {
    fn borrow(&self) -> &(dyn StateKey + 'a) {
        self
    }
}

impl PartialEq for dyn StateKey + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn StateKey + '_ {}

impl PartialOrd for dyn StateKey + '_ {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for dyn StateKey + '_ {
    fn cmp(&self, other: &Self) -> Ordering {
        self.parts().cmp(&other.parts())
    }
}

/// `map`'s value under (`pipeline`, `skey`).
pub(crate) fn at<'m, V>(
    map: &'m BTreeMap<(String, Vec<u8>), V>,
    pipeline: &str,
    skey: &[u8],
) -> Option<&'m V> {
    map.get(&(pipeline, skey) as &dyn StateKey)
}

/// `map`'s value under (`pipeline`, `skey`), to change in place.
pub(crate) fn at_mut<'m, V>(
    map: &'m mut BTreeMap<(String, Vec<u8>), V>,
    pipeline: &str,
    skey: &[u8],
) -> Option<&'m mut V> {
    map.get_mut(&(pipeline, skey) as &dyn StateKey)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrowed_lookups_find_what_owned_ones_do_in_the_same_order() {
        // Names that are prefixes of each other, and keys that are, and empty ones: the
        // owned tuple orders by the whole name first, so ("a", "b...") < ("ab", "").
        let names = ["", "a", "ab", "b"];
        let keys: [&[u8]; 5] = [b"", b"\x00", b"a", b"ab", b"\xff"];
        let mut map = BTreeMap::new();
        for (i, n) in names.iter().enumerate() {
            for (j, k) in keys.iter().enumerate() {
                if (i + j) % 2 == 0 {
                    map.insert((n.to_string(), k.to_vec()), i * 10 + j);
                }
            }
        }
        for (i, n) in names.iter().enumerate() {
            for (j, k) in keys.iter().enumerate() {
                let want = map.get(&(n.to_string(), k.to_vec())).copied();
                assert_eq!(at(&map, n, k).copied(), want, "{n:?} {k:?}");
                assert_eq!(want.is_some(), (i + j) % 2 == 0);
            }
        }
        *at_mut(&mut map, "ab", b"").unwrap() = 7;
        assert_eq!(map[&("ab".to_string(), Vec::new())], 7);
        assert_eq!(at_mut(&mut map, "ab", b"\x00"), None);
    }
}
