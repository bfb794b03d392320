//! Decoded chunks kept for reuse, most recently used first. The outbox keeps one (the
//! ledger reads its chunks without decoding them) of at most 128: a linear scan over that
//! many `u64` keys is a few cache lines, cheaper than keeping a map beside the order.

pub(crate) struct Lru<K, V> {
    capacity: usize,
    entries: Vec<(K, V)>,
}

impl<K: PartialEq, V: Clone> Lru<K, V> {
    pub fn new(capacity: usize) -> Self {
        Lru {
            capacity,
            entries: Vec::with_capacity(capacity),
        }
    }

    /// The value under `key`, which becomes the most recently used.
    pub fn get<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: std::borrow::Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        let i = self.entries.iter().position(|(k, _)| k.borrow() == key)?;
        let e = self.entries.remove(i);
        let v = e.1.clone();
        self.entries.insert(0, e);
        Some(v)
    }

    /// Keep `value` under `key` as the most recently used; the least recently used goes if
    /// there is no room.
    pub(crate) fn put(&mut self, key: K, value: V) {
        self.entries.retain(|(k, _)| *k != key);
        self.entries.insert(0, (key, value));
        self.entries.truncate(self.capacity);
    }

    pub(crate) fn forget<Q>(&mut self, key: &Q)
    where
        K: std::borrow::Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        self.entries.retain(|(k, _)| k.borrow() != key);
    }

    #[cfg(test)]
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_goes_first() {
        let mut c: Lru<u64, &str> = Lru::new(2);
        c.put(1, "a");
        c.put(2, "b");
        assert_eq!(c.get(&1), Some("a")); // 1 is now the most recent
        c.put(3, "c");
        assert_eq!(c.get(&2), None, "2 was the least recently used");
        assert_eq!((c.get(&1), c.get(&3)), (Some("a"), Some("c")));
        c.forget(&1);
        assert_eq!(c.get(&1), None);
        c.clear();
        assert_eq!(c.get(&3), None);
    }
}
