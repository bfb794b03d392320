//! A deterministic, mergeable quantile sketch with a bounded size, for the `pNN` aggregates.
//!
//! Values are counted in log-linear buckets read straight from the bits of the `f64`: the
//! sign, the exponent and the top [`MANTISSA_BITS`] bits of the mantissa name the bucket. No
//! logarithm is computed, so every build on every machine puts a value in the same bucket,
//! and replay recomputes a percentile bit for bit. Each power of two is split into 128
//! buckets, so a bucket's lower bound is within 1/128 (0.79 %) of every value in it; a
//! percentile reports that lower bound (of the magnitude), hence it is never further from
//! zero than the true value and at most 0.79 % closer to it. Integers of magnitude below 256
//! fall exactly on a bucket bound and are reported exactly.
//!
//! Memory is bounded: at most [`MAX_BUCKETS`] buckets per key. When a key's values spread
//! over more, the buckets nearest zero are folded into the zero bucket, so only the values
//! closest to zero lose accuracy (DDSketch's "collapsing lowest" rule, here on magnitudes).
//!
//! In memory a sketch is packed: each bucket as two varints, its distance from the bucket
//! before it (the first: its own value, zigzagged) and its count, about 2 to 3 bytes a
//! bucket. A list of `(i32, u64)` took 16 bytes a bucket, and up to twice that with a
//! vector's spare room, in the checkpoint's batch and again in the one in flight: a drain
//! of 16 pipelines (six of them sketches) over 1,000 keys with every key in one checkpoint
//! peaked at 111.9 MiB, and at 79.1 MiB packed (issue 33).
//!
//! The store keeps the packing itself (store format 6): a varint of [`PACKED_MARK`] plus its
//! length, then its bytes. Before, it kept the list (postcard: the list's length, then per
//! bucket the zigzag varint of the bucket and the varint count), about 4 bytes a bucket,
//! since a bucket's own number takes three; packed, a bucket's distance from the one before
//! mostly takes one, and a sketch of 156 buckets stores in 318 bytes instead of 625. A
//! checkpoint writes a key's whole row, so every byte of a sketch is written again each
//! time its key changes, and the span of a checkpoint is weighed in those bytes. A list
//! still reads (a store of format 5 or before, whose lists are never that long), so stores
//! of every format read as they did; the size a sketch takes is known exactly without
//! encoding it ([`Sketch::stored_len`]), which is what a checkpoint weighs a row by.

use serde::ser::{SerializeSeq, SerializeStruct, SerializeTuple};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Mantissa bits kept: 2^7 = 128 buckets per power of two.
pub(crate) const MANTISSA_BITS: u32 = 7;
/// Most buckets one sketch holds. A bucket costs 2 to 13 bytes in the store (a varint
/// distance from the bucket before, at most 3 bytes since buckets lie within ±2^19, and a
/// varint count), typically 2 or 3, so a sketch stays near 1 KiB and below 6.5 KiB at
/// worst. sled writes a leaf of up to ~17 values as one log item and moves items over
/// ~128 KiB to blob files it never fsyncs, so even a leaf full of worst-case sketches
/// must stay below that: 17 × 6.5 KiB leaves room for keys and the other aggregates.
pub(crate) const MAX_BUCKETS: usize = 512;
/// Largest relative error of a reported percentile with respect to the value at its rank,
/// while no buckets were folded: 2^-MANTISSA_BITS. Only the tests check against it.
#[cfg(test)]
pub(crate) const RELATIVE_ERROR: f64 = 1.0 / 128.0;

const SHIFT: u32 = 52 - MANTISSA_BITS;

/// Added to a stored packing's length, so that it reads apart from a stored list, whose
/// first varint is its number of buckets: a list that long would not fit an entry.
const PACKED_MARK: u64 = 1 << 20;
/// The longest packing: every bucket's distance and count at their longest (5 and 10 bytes).
const MAX_PACKED: usize = MAX_BUCKETS * 15;

/// Counts per bucket, in ascending bucket order (which is the order of the values). Bucket 0
/// holds zero; bucket `b > 0` holds positive values whose magnitude bits, shifted, are
/// `b - 1`; bucket `-b` the negative values of the same magnitude.
///
/// Packed (see the module's text); every list of buckets has exactly one packing, so two
/// sketches are equal when their buckets and counts are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sketch {
    /// Per bucket, ascending: the varint of its distance from the previous bucket (the
    /// first: its zigzagged value), then the varint of its count.
    packed: Vec<u8>,
    /// Buckets held, at most [`MAX_BUCKETS`].
    len: u32,
    /// Values counted (saturating), kept so that a percentile walks the buckets once.
    total: u64,
}

/// The bucket of a finite value.
fn bucket_of(x: f64) -> i32 {
    if x == 0.0 {
        return 0;
    }
    // Positive finite f64 bits are below 0x7ff0 << 48, so the shifted value is below 2^19.
    let b = (x.abs().to_bits() >> SHIFT) as i32 + 1;
    if x < 0.0 { -b } else { b }
}

/// The lower bound (in magnitude) of a bucket's values.
fn bound_of(bucket: i32) -> f64 {
    if bucket == 0 {
        return 0.0;
    }
    let mag = f64::from_bits(u64::from(bucket.unsigned_abs() - 1) << SHIFT);
    if bucket < 0 { -mag } else { mag }
}

fn zigzag(b: i32) -> u64 {
    u64::from(((b << 1) ^ (b >> 31)) as u32)
}

fn unzigzag(z: u64) -> i32 {
    let z = z as u32;
    ((z >> 1) as i32) ^ -((z & 1) as i32)
}

fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// A varint into `out`, returning its length (at most 10).
fn put_varint(out: &mut [u8; 10], mut v: u64) -> usize {
    let mut n = 0;
    while v >= 0x80 {
        out[n] = (v as u8) | 0x80;
        v >>= 7;
        n += 1;
    }
    out[n] = v as u8;
    n + 1
}

/// The varint at `*at`, moving past it. The packing is this module's own, always whole.
#[inline]
fn get_varint(bytes: &[u8], at: &mut usize) -> u64 {
    // Most distances and counts are below 128: one byte.
    let first = bytes[*at];
    if first < 0x80 {
        *at += 1;
        return u64::from(first);
    }
    let mut v = 0u64;
    let mut shift = 0;
    loop {
        let b = bytes[*at];
        *at += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return v;
        }
        shift += 7;
    }
}

/// What a bucket is packed as: its distance from `prev` (its zigzag value if first).
fn step(prev: Option<i32>, bucket: i32) -> u64 {
    match prev {
        None => zigzag(bucket),
        Some(p) => (i64::from(bucket) - i64::from(p)) as u64,
    }
}

fn unstep(prev: Option<i32>, d: u64) -> i32 {
    match prev {
        None => unzigzag(d),
        Some(p) => (i64::from(p) + d as i64) as i32,
    }
}

/// One packed bucket, with where its two varints are.
struct At {
    start: usize,
    count_at: usize,
    end: usize,
    bucket: i32,
    count: u64,
}

/// The buckets in order, with their places in the packing.
struct Walk<'a> {
    packed: &'a [u8],
    at: usize,
    prev: Option<i32>,
}

impl Iterator for Walk<'_> {
    type Item = At;

    fn next(&mut self) -> Option<At> {
        if self.at >= self.packed.len() {
            return None;
        }
        let start = self.at;
        let bucket = unstep(self.prev, get_varint(self.packed, &mut self.at));
        let count_at = self.at;
        let count = get_varint(self.packed, &mut self.at);
        self.prev = Some(bucket);
        Some(At {
            start,
            count_at,
            end: self.at,
            bucket,
            count,
        })
    }
}

impl Sketch {
    /// A sketch of one value.
    pub fn of(x: f64) -> Sketch {
        let mut s = Sketch::default();
        s.add_count(bucket_of(x), 1);
        s
    }

    /// Count one more value. `None` if a bucket's count would overflow.
    pub fn insert(&self, x: f64) -> Option<Sketch> {
        // Room for the largest change one bucket makes (a new bucket and its successor's
        // distance again), so the new sketch holds no spare room to grow into.
        let mut packed = Vec::with_capacity(self.packed.len() + 25);
        packed.extend_from_slice(&self.packed);
        let mut s = Sketch { packed, ..*self };
        s.add_count(bucket_of(x), 1)?;
        Some(s)
    }

    /// Everything both sketches counted: merging is exact (bucket counts add) and
    /// order-independent, up to the folding of buckets beyond [`MAX_BUCKETS`].
    #[cfg(test)] // only the tests merge sketches (a property of the encoding)
    pub(crate) fn merge(&self, other: &Sketch) -> Option<Sketch> {
        let mut s = self.clone();
        for (b, n) in other.pairs() {
            s.add_count(b, n)?;
        }
        Some(s)
    }

    /// The buckets and their counts, in ascending bucket order.
    pub(crate) fn pairs(&self) -> impl Iterator<Item = (i32, u64)> + '_ {
        self.walk().map(|a| (a.bucket, a.count))
    }

    fn walk(&self) -> Walk<'_> {
        Walk {
            packed: &self.packed,
            at: 0,
            prev: None,
        }
    }

    /// Values counted (at most `u64::MAX`).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Buckets held.
    pub(crate) fn buckets(&self) -> usize {
        self.len as usize
    }

    /// Exactly the bytes this sketch takes in the store (postcard).
    pub(crate) fn stored_len(&self) -> usize {
        varint_len(PACKED_MARK + self.packed.len() as u64) + self.packed.len()
    }

    /// Replace `packed[range]` with the varints of `values` (at most three).
    fn splice(&mut self, range: std::ops::Range<usize>, values: &[u64]) {
        let mut buf = [0u8; 30];
        let mut n = 0;
        for &v in values {
            let mut one = [0u8; 10];
            let k = put_varint(&mut one, v);
            buf[n..n + k].copy_from_slice(&one[..k]);
            n += k;
        }
        let (len, old) = (self.packed.len(), range.end - range.start);
        if n > old {
            self.packed.resize(len + n - old, 0);
            self.packed.copy_within(range.end..len, range.end + n - old);
        } else if n < old {
            self.packed
                .copy_within(range.end..len, range.end - (old - n));
            self.packed.truncate(len - (old - n));
        }
        self.packed[range.start..range.start + n].copy_from_slice(&buf[..n]);
    }

    /// Put varints after the last bucket.
    fn push(&mut self, values: &[u64]) {
        for &v in values {
            let mut one = [0u8; 10];
            let k = put_varint(&mut one, v);
            self.packed.extend_from_slice(&one[..k]);
        }
    }

    fn add_count(&mut self, bucket: i32, n: u64) -> Option<()> {
        let mut prev = None;
        let mut walk = self.walk();
        let mut place = None;
        for a in walk.by_ref() {
            if a.bucket >= bucket {
                place = Some(a);
                break;
            }
            prev = Some(a.bucket);
        }
        match place {
            Some(a) if a.bucket == bucket => {
                let c = a.count.checked_add(n)?;
                self.splice(a.count_at..a.end, &[c]);
                self.total = self.total.saturating_add(n);
            }
            // Before `a`, whose distance is then counted from the new bucket.
            Some(a) => {
                let values = [step(prev, bucket), n, step(Some(bucket), a.bucket)];
                self.splice(a.start..a.count_at, &values);
                self.grew(n);
            }
            None => {
                self.push(&[step(prev, bucket), n]);
                self.grew(n);
            }
        }
        if self.buckets() > MAX_BUCKETS {
            self.fold_nearest_zero()?;
        }
        Some(())
    }

    fn grew(&mut self, n: u64) {
        self.len += 1;
        self.total = self.total.saturating_add(n);
    }

    /// Fold the non-zero buckets of smallest magnitude (of two of equal magnitude, the
    /// negative one first) into the zero bucket until at most [`MAX_BUCKETS`] are left,
    /// as if one at a time.
    fn fold_nearest_zero(&mut self) -> Option<()> {
        let list: Vec<(i32, u64)> = self.pairs().collect();
        // Ascending, so those nearest zero lie on either side of it: walk outwards.
        let split = list.partition_point(|&(b, _)| b < 0);
        let had_zero = list.get(split).is_some_and(|&(b, _)| b == 0);
        let (mut lo, mut hi) = (split, split + usize::from(had_zero));
        let mut sum = if had_zero { list[split].1 } else { 0 };
        // A zero bucket made by the first fold takes a place too.
        for _ in 0..(list.len() + usize::from(!had_zero)).saturating_sub(MAX_BUCKETS) {
            let below = lo.checked_sub(1).map(|i| list[i].0);
            let negative = match (below, list.get(hi).map(|p| p.0)) {
                (Some(n), Some(p)) => (n.unsigned_abs(), n) < (p.unsigned_abs(), p),
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => return None,
            };
            let i = if negative {
                lo -= 1;
                lo
            } else {
                hi += 1;
                hi - 1
            };
            sum = sum.checked_add(list[i].1)?;
        }
        let zero = [(0, sum)];
        let kept = list[..lo].iter().chain(&zero).chain(&list[hi..]);
        *self = Sketch::packing(kept.copied());
        Some(())
    }

    /// The packing of a list in strictly ascending bucket order.
    fn packing(list: impl IntoIterator<Item = (i32, u64)>) -> Sketch {
        let list = list.into_iter();
        let mut s = Sketch {
            packed: Vec::with_capacity(list.size_hint().0 * 3),
            ..Sketch::default()
        };
        let mut prev = None;
        for (b, n) in list {
            s.push(&[step(prev, b), n]);
            s.grew(n);
            prev = Some(b);
        }
        s
    }

    /// A sketch from the store's list, which this build writes in ascending order with no
    /// bucket twice. Any other list (a damaged store) is put in order, its repeated buckets
    /// added and its extra buckets folded, as if its values had been counted here; `None`
    /// if a count would overflow.
    fn from_stored(mut list: Vec<(i32, u64)>) -> Option<Sketch> {
        if !list.windows(2).all(|w| w[0].0 < w[1].0) {
            list.sort_by_key(|&(b, _)| b);
            let mut merged: Vec<(i32, u64)> = Vec::with_capacity(list.len());
            for (b, n) in list {
                match merged.last_mut() {
                    Some(last) if last.0 == b => last.1 = last.1.checked_add(n)?,
                    _ => merged.push((b, n)),
                }
            }
            list = merged;
        }
        let mut s = Sketch::packing(list);
        if s.buckets() > MAX_BUCKETS {
            s.fold_nearest_zero()?;
        }
        Some(s)
    }

    /// The `permille`/1000 quantile by the nearest-rank rule: the value at rank
    /// `ceil(q · n)` (at least 1) in ascending order, as its bucket's bound. Integer
    /// arithmetic, so the rank never depends on float rounding. `None` when empty.
    pub(crate) fn quantile(&self, permille: u16) -> Option<f64> {
        let n = u128::from(self.total());
        if n == 0 {
            return None;
        }
        let rank = (u128::from(permille) * n).div_ceil(1000).max(1);
        let mut seen = 0u128;
        let mut last = None;
        for (b, c) in self.pairs() {
            seen += u128::from(c);
            if seen >= rank {
                return Some(bound_of(b));
            }
            last = Some(b);
        }
        last.map(bound_of)
    }
}

impl Sketch {
    /// A sketch from a stored packing (see the module's text). One this build wrote is taken
    /// as it is; any other that reads as a list of buckets (out of order, a bucket twice,
    /// too many, a varint longer than it needs: a damaged store) is taken as that list is
    /// by [`Sketch::from_stored`], so that every list of buckets still has one packing.
    /// `None` if it does not read as a list of buckets, or a count would overflow.
    fn from_packed(packed: Vec<u8>) -> Option<Sketch> {
        let mut list = Vec::new();
        let (mut at, mut prev, mut canonical) = (0, None::<i32>, true);
        while at < packed.len() {
            let (d, dn) = read_varint(&packed[at..])?;
            let (count, cn) = read_varint(&packed[at + dn..])?;
            canonical &= dn == varint_len(d) && cn == varint_len(count);
            let bucket = match prev {
                None => unzigzag(u64::from(u32::try_from(d).ok()?)),
                Some(p) => {
                    let b =
                        i32::try_from(i64::from(p).checked_add(i64::try_from(d).ok()?)?).ok()?;
                    canonical &= b > p;
                    b
                }
            };
            list.push((bucket, count));
            prev = Some(bucket);
            at += dn + cn;
        }
        if !canonical || list.len() > MAX_BUCKETS {
            return Sketch::from_stored(list);
        }
        let total = (list.iter()).fold(0u64, |t, &(_, n)| t.saturating_add(n));
        Some(Sketch {
            packed,
            len: list.len() as u32,
            total,
        })
    }
}

/// A varint at the start of `bytes` and its length; `None` if it is cut short or longer
/// than a `u64`.
fn read_varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, &b) in bytes.iter().enumerate().take(10) {
        let part = u64::from(b & 0x7f);
        if i == 9 && part > 1 {
            return None;
        }
        v |= part << (7 * i);
        if b < 0x80 {
            return Some((v, i + 1));
        }
    }
    None
}

/// In the store: `{ buckets: (PACKED_MARK + n, n packed bytes) }` (postcard writes a tuple's
/// elements with no length). Where the format is meant to be read (JSON), the list of
/// `(bucket, count)` pairs, as it was stored before format 6.
impl Serialize for Sketch {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        struct Pairs<'a>(&'a Sketch);
        impl Serialize for Pairs<'_> {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let mut seq = serializer.serialize_seq(Some(self.0.buckets()))?;
                for pair in self.0.pairs() {
                    seq.serialize_element(&pair)?;
                }
                seq.end()
            }
        }
        struct Packed<'a>(&'a [u8]);
        impl Serialize for Packed<'_> {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let mut t = serializer.serialize_tuple(1 + self.0.len())?;
                t.serialize_element(&(PACKED_MARK + self.0.len() as u64))?;
                for b in self.0 {
                    t.serialize_element(b)?;
                }
                t.end()
            }
        }
        let readable = serializer.is_human_readable();
        let mut st = serializer.serialize_struct("Sketch", 1)?;
        if readable {
            st.serialize_field("buckets", &Pairs(self))?;
        } else {
            st.serialize_field("buckets", &Packed(&self.packed))?;
        }
        st.end()
    }
}
/// Reads what [`Sketch`]'s `Serialize` writes, and the list every format before 6 stored.
impl<'de> Deserialize<'de> for Sketch {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Sketch, D::Error> {
        #[derive(Deserialize)]
        #[serde(rename = "Sketch")]
        struct Listed {
            buckets: Vec<(i32, u64)>,
        }
        #[derive(Deserialize)]
        #[serde(rename = "Sketch")]
        struct Stored {
            buckets: StoredBuckets,
        }
        if deserializer.is_human_readable() {
            let listed = Listed::deserialize(deserializer)?;
            return Sketch::from_stored(listed.buckets)
                .ok_or_else(|| serde::de::Error::custom("a sketch's bucket counts overflow"));
        }
        Ok(Stored::deserialize(deserializer)?.buckets.0)
    }
}

/// A stored sketch's buckets: a packing or a list (see the module's text).
struct StoredBuckets(Sketch);

impl<'de> Deserialize<'de> for StoredBuckets {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // A tuple, whose length postcard does not read: the first varint says what follows.
        deserializer.deserialize_tuple(usize::MAX, BucketsVisitor)
    }
}

struct BucketsVisitor;

impl<'de> serde::de::Visitor<'de> for BucketsVisitor {
    type Value = StoredBuckets;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a sketch's packed buckets, or a list of (bucket, count)")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> Result<StoredBuckets, A::Error> {
        use serde::de::Error;
        let short = || A::Error::custom("a stored sketch ends early");
        let first: u64 = seq.next_element()?.ok_or_else(short)?;
        let sketch = if first >= PACKED_MARK {
            let len = usize::try_from(first - PACKED_MARK)
                .ok()
                .filter(|&n| n <= MAX_PACKED)
                .ok_or_else(|| A::Error::custom("a stored sketch longer than any sketch"))?;
            let mut packed = Vec::with_capacity(len);
            for _ in 0..len {
                packed.push(seq.next_element::<u8>()?.ok_or_else(short)?);
            }
            Sketch::from_packed(packed)
                .ok_or_else(|| A::Error::custom("a stored sketch that is not a list of buckets"))?
        } else {
            // A list as formats before 6 stored it: never longer than an entry holds, but
            // room is made as the pairs come, not on the word of the length.
            let mut list = Vec::with_capacity(MAX_BUCKETS.min(first as usize));
            for _ in 0..first {
                list.push(seq.next_element::<(i32, u64)>()?.ok_or_else(short)?);
            }
            Sketch::from_stored(list)
                .ok_or_else(|| A::Error::custom("a sketch's bucket counts overflow"))?
        };
        Ok(StoredBuckets(sketch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact nearest-rank quantile.
    fn exact(values: &[f64], permille: u16) -> f64 {
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len() as u128;
        let rank = (u128::from(permille) * n).div_ceil(1000).max(1);
        v[rank as usize - 1]
    }

    #[test]
    fn percentiles_are_within_the_documented_error() {
        let values: Vec<f64> = (0..5000)
            .map(|i| {
                let x = (i as f64 * 7.31).sin() * 1e4 + (i % 17) as f64 * 0.013;
                if i % 3 == 0 { -x } else { x }
            })
            .collect();
        let mut s = Sketch::of(values[0]);
        for &x in &values[1..] {
            s = s.insert(x).unwrap();
        }
        assert_eq!(s.total(), 5000);
        for q in [1, 10, 250, 500, 900, 950, 990, 999] {
            let want = exact(&values, q);
            let got = s.quantile(q).unwrap();
            assert!(
                (got - want).abs() <= want.abs() * RELATIVE_ERROR,
                "p{q}: {got} vs {want}"
            );
            assert!(
                got.abs() <= want.abs(),
                "reported nearer zero, never further"
            );
        }
    }

    #[test]
    fn small_integers_are_exact() {
        let mut s = Sketch::of(-255.0);
        for i in -254..=255 {
            s = s.insert(f64::from(i)).unwrap();
        }
        assert_eq!(s.quantile(500), Some(0.0));
        assert_eq!(s.quantile(1), Some(-255.0));
        assert_eq!(s.quantile(999), Some(255.0));
        assert_eq!(s.quantile(750), Some(128.0));
    }

    #[test]
    fn merging_is_order_independent_and_exact() {
        let a: Vec<f64> = (1..300).map(|i| f64::from(i) * 1.7).collect();
        let b: Vec<f64> = (1..200).map(|i| -f64::from(i) * 0.3).collect();
        let build = |v: &[f64]| {
            v.iter()
                .fold(Sketch::default(), |s, &x| s.insert(x).unwrap())
        };
        let (sa, sb) = (build(&a), build(&b));
        let all: Vec<f64> = a.iter().chain(&b).copied().collect();
        assert_eq!(sa.merge(&sb), sb.merge(&sa));
        assert_eq!(sa.merge(&sb).unwrap(), build(&all));
    }

    #[test]
    fn the_bucket_count_and_encoded_size_stay_bounded() {
        // Values spread over every power of two from 2^-60 to 2^52, both signs.
        let mut s = Sketch::default();
        let mut x = 1.0e-18_f64;
        let mut i = 0u64;
        while x < 4.0e15 {
            s = s.insert(if i % 2 == 0 { x } else { -x }).unwrap();
            x *= 1.003;
            i += 1;
        }
        assert_eq!(s.buckets(), MAX_BUCKETS);
        assert_eq!(s.total(), i);
        let bytes = postcard::to_stdvec(&s).unwrap().len();
        assert!(bytes <= 4 * 1024, "{bytes} bytes");
        // The worst case: every count needs a 10-byte varint.
        let worst = Sketch::packing(s.pairs().map(|(b, _)| (b, u64::MAX)));
        let bytes = postcard::to_stdvec(&worst).unwrap().len();
        assert!(17 * (bytes + 256) < 128 * 1024, "{bytes} bytes");
        // The largest values keep their accuracy; only those nearest zero were folded.
        let top = s.quantile(1000).unwrap();
        assert!(top > 3.9e15 * (1.0 - RELATIVE_ERROR) && top < 4.0e15);
    }

    #[test]
    fn an_overflowing_count_is_refused() {
        let s = Sketch::packing([(bucket_of(1.0), u64::MAX)]);
        assert_eq!(s.insert(1.0), None);
        assert!(s.insert(2.0).is_some());
    }

    /// The sketch as it was kept before it was packed: a list, the store's very shape.
    #[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
    struct Listed {
        buckets: Vec<(i32, u64)>,
    }

    impl Listed {
        fn add(&mut self, bucket: i32, n: u64) -> Option<()> {
            match self.buckets.binary_search_by_key(&bucket, |&(b, _)| b) {
                Ok(i) => self.buckets[i].1 = self.buckets[i].1.checked_add(n)?,
                Err(i) => self.buckets.insert(i, (bucket, n)),
            }
            while self.buckets.len() > MAX_BUCKETS {
                let (i, _) = (self.buckets.iter().enumerate())
                    .filter(|(_, (b, _))| *b != 0)
                    .min_by_key(|(_, (b, _))| (b.unsigned_abs(), *b))?;
                let (_, n) = self.buckets.remove(i);
                match self.buckets.binary_search_by_key(&0, |&(b, _)| b) {
                    Ok(z) => self.buckets[z].1 = self.buckets[z].1.checked_add(n)?,
                    Err(z) => self.buckets.insert(z, (0, n)),
                }
            }
            Some(())
        }
    }

    /// Values that fill few buckets, spread over many (so that buckets are folded), zero,
    /// and the extremes.
    fn value() -> impl proptest::strategy::Strategy<Value = f64> {
        use proptest::prelude::*;
        prop_oneof![
            (-300i32..300).prop_map(f64::from),
            (-70i32..70, 0u32..128, any::<bool>()).prop_map(|(e, m, neg)| {
                let x = 2f64.powi(e) * (1.0 + f64::from(m) / 128.0);
                if neg { -x } else { x }
            }),
            Just(0.0),
            Just(f64::MAX),
            Just(-f64::MAX),
            Just(f64::MIN_POSITIVE),
            Just(-5e-324),
        ]
    }

    /// Checks the packed sketch against the list it stands for, in every way it is read:
    /// stored packed, it reads back as itself, and so does the list a store before format 6
    /// holds for it.
    fn same(packed: &Sketch, listed: &Listed) {
        assert_eq!(packed.pairs().collect::<Vec<_>>(), listed.buckets);
        assert_eq!(packed.buckets(), listed.buckets.len());
        let bytes = postcard::to_stdvec(packed).unwrap();
        assert_eq!(packed.stored_len(), bytes.len());
        assert_eq!(&postcard::from_bytes::<Sketch>(&bytes).unwrap(), packed);
        let old = postcard::to_stdvec(listed).unwrap();
        assert_eq!(&postcard::from_bytes::<Sketch>(&old).unwrap(), packed);
        let json = serde_json::to_string(packed).unwrap();
        assert_eq!(json, serde_json::to_string(listed).unwrap());
        assert_eq!(&serde_json::from_str::<Sketch>(&json).unwrap(), packed);
        let total = (listed.buckets.iter()).fold(0u64, |t, &(_, n)| t.saturating_add(n));
        assert_eq!(packed.total(), total);
    }

    /// A stored packing: the marked length, then the bytes.
    fn stored(bytes: &[u8]) -> Vec<u8> {
        let mut out = [0u8; 10];
        let n = put_varint(&mut out, PACKED_MARK + bytes.len() as u64);
        [&out[..n], bytes].concat()
    }

    #[test]
    fn a_sketch_stores_in_about_half_the_bytes_of_its_list() {
        // Integers 0..1000, 200 of them: the benchmark's keys (issue 33).
        let (mut s, mut listed) = (Sketch::default(), Listed::default());
        let mut x = 7u64;
        for _ in 0..200 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = (x % 1000) as f64;
            s = s.insert(v).unwrap();
            listed.add(bucket_of(v), 1).unwrap();
        }
        let (new, old) = (
            postcard::to_stdvec(&s).unwrap().len(),
            postcard::to_stdvec(&listed).unwrap().len(),
        );
        assert!(s.buckets() > 100, "{}", s.buckets());
        assert!(new * 10 < old * 6, "{new} bytes packed, {old} listed");
    }

    #[test]
    fn a_stored_packing_cut_short_or_too_long_is_refused() {
        let mut s = Sketch::of(3.0);
        for v in [5.0, -2.0, 1e9, 0.0] {
            s = s.insert(v).unwrap();
        }
        let bytes = postcard::to_stdvec(&s).unwrap();
        for cut in 1..bytes.len() {
            assert!(
                postcard::from_bytes::<Sketch>(&bytes[..cut]).is_err(),
                "{cut}"
            );
        }
        // A count's varint cut in the middle of the packing.
        assert!(postcard::from_bytes::<Sketch>(&stored(&[2, 0x81])).is_err());
        // Longer than any sketch: refused before anything is read or reserved.
        let mut huge = [0u8; 10];
        let n = put_varint(&mut huge, PACKED_MARK + MAX_PACKED as u64 + 1);
        assert!(postcard::from_bytes::<Sketch>(&huge[..n]).is_err());
        let n = put_varint(&mut huge, u64::MAX);
        assert!(postcard::from_bytes::<Sketch>(&huge[..n]).is_err());
        // A bucket past i32, first or by its distance.
        assert!(
            postcard::from_bytes::<Sketch>(&stored(&[0xff, 0xff, 0xff, 0xff, 0x1f, 1])).is_err()
        );
        let far = [2, 1, 0xff, 0xff, 0xff, 0xff, 0x0f, 1];
        assert!(postcard::from_bytes::<Sketch>(&stored(&far)).is_err());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]

        /// Packed, a sketch counts, folds, refuses, reports and is stored exactly as the
        /// list it replaced.
        #[test]
        fn a_packed_sketch_is_the_list_it_replaced(
            values in proptest::collection::vec(value(), 1..1500),
            big in proptest::option::of(0usize..1500),
        ) {
            let mut packed = Sketch::default();
            let mut listed = Listed::default();
            for (i, &x) in values.iter().enumerate() {
                // Now and then a count near the top, to meet the overflow.
                let n = if big == Some(i) { u64::MAX - 1 } else { 1 };
                let mut want = listed.clone();
                let accepted = want.add(bucket_of(x), n).is_some();
                let mut next = packed.clone();
                let got = next.add_count(bucket_of(x), n);
                proptest::prop_assert_eq!(got.is_some(), accepted);
                if n == 1 {
                    proptest::prop_assert_eq!(packed.insert(x), got.map(|()| next.clone()));
                }
                if accepted {
                    (packed, listed) = (next, want);
                }
            }
            same(&packed, &listed);
            for q in [0, 1, 500, 990, 1000] {
                let rank = |s: &Listed| {
                    let n: u128 = s.buckets.iter().map(|&(_, c)| u128::from(c)).sum();
                    let rank = (u128::from(q) * n).div_ceil(1000).max(1);
                    let mut seen = 0u128;
                    s.buckets.iter().find(|&&(_, c)| {
                        seen += u128::from(c);
                        seen >= rank
                    }).map(|&(b, _)| bound_of(b))
                };
                if packed.total() < u64::MAX {
                    proptest::prop_assert_eq!(packed.quantile(q), rank(&listed));
                }
            }
        }

        /// A stored list out of order, with a bucket twice or too many buckets (a damaged
        /// store) reads as the sketch that counted the same values, never panics.
        #[test]
        fn any_stored_list_reads_as_its_values_counted(
            list in proptest::collection::vec((proptest::prelude::any::<i32>(), 1u64..1000), 0..1200),
        ) {
            let mut listed = Listed::default();
            for &(b, n) in &list {
                listed.add(b, n).unwrap();
            }
            let bytes = postcard::to_stdvec(&Listed { buckets: list }).unwrap();
            let read: Sketch = postcard::from_bytes(&bytes).unwrap();
            same(&read, &listed);
        }

        /// Any bytes stored as a packing (a damaged store) read as a sketch that keeps every
        /// rule of one this build made, or are refused; never a panic.
        #[test]
        fn any_stored_packing_reads_as_a_sound_sketch_or_is_refused(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..700),
        ) {
            if let Ok(read) = postcard::from_bytes::<Sketch>(&stored(&bytes)) {
                let pairs: Vec<(i32, u64)> = read.pairs().collect();
                proptest::prop_assert!(pairs.windows(2).all(|w| w[0].0 < w[1].0));
                proptest::prop_assert!(read.buckets() == pairs.len() && pairs.len() <= MAX_BUCKETS);
                let again = postcard::to_stdvec(&read).unwrap();
                proptest::prop_assert_eq!(read.stored_len(), again.len());
                proptest::prop_assert_eq!(&postcard::from_bytes::<Sketch>(&again).unwrap(), &read);
                let listed = Listed { buckets: pairs };
                proptest::prop_assert_eq!(
                    &postcard::from_bytes::<Sketch>(&postcard::to_stdvec(&listed).unwrap()).unwrap(),
                    &read
                );
            }
        }
    }

    #[test]
    fn a_stored_list_whose_counts_overflow_is_refused() {
        let bytes = postcard::to_stdvec(&Listed {
            buckets: vec![(3, u64::MAX), (1, 1), (3, 1)],
        })
        .unwrap();
        assert!(postcard::from_bytes::<Sketch>(&bytes).is_err());
    }
}
