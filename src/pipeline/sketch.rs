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

use serde::{Deserialize, Serialize};

/// Mantissa bits kept: 2^7 = 128 buckets per power of two.
pub(crate) const MANTISSA_BITS: u32 = 7;
/// Most buckets one sketch holds. A bucket costs 2 to 13 bytes in the store (a varint key
/// and a varint count), typically 4, so a sketch stays near 2 KiB and below 6.5 KiB at
/// worst. sled writes a leaf of up to ~17 values as one log item and moves items over
/// ~128 KiB to blob files it never fsyncs, so even a leaf full of worst-case sketches
/// must stay below that: 17 × 6.5 KiB leaves room for keys and the other aggregates.
pub(crate) const MAX_BUCKETS: usize = 512;
/// Largest relative error of a reported percentile with respect to the value at its rank,
/// while no buckets were folded: 2^-MANTISSA_BITS. Only the tests check against it.
#[cfg(test)]
pub(crate) const RELATIVE_ERROR: f64 = 1.0 / 128.0;

const SHIFT: u32 = 52 - MANTISSA_BITS;

/// Counts per bucket, sorted by bucket (which is the order of the values). Bucket 0 holds
/// zero; bucket `b > 0` holds positive values whose magnitude bits, shifted, are `b - 1`;
/// bucket `-b` the negative values of the same magnitude.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sketch {
    buckets: Vec<(i32, u64)>,
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

impl Sketch {
    /// A sketch of one value.
    pub fn of(x: f64) -> Sketch {
        let mut s = Sketch::default();
        s.add_count(bucket_of(x), 1);
        s
    }

    /// Count one more value. `None` if a bucket's count would overflow.
    pub fn insert(&self, x: f64) -> Option<Sketch> {
        let mut s = self.clone();
        s.add_count(bucket_of(x), 1)?;
        Some(s)
    }

    /// Everything both sketches counted: merging is exact (bucket counts add) and
    /// order-independent, up to the folding of buckets beyond [`MAX_BUCKETS`].
    #[cfg(test)] // only the tests merge sketches (a property of the encoding)
    pub(crate) fn merge(&self, other: &Sketch) -> Option<Sketch> {
        let mut s = self.clone();
        for &(b, n) in &other.buckets {
            s.add_count(b, n)?;
        }
        Some(s)
    }

    /// Values counted.
    pub fn total(&self) -> u64 {
        self.buckets
            .iter()
            .fold(0u64, |t, &(_, n)| t.saturating_add(n))
    }

    /// Buckets held: what its size in the store grows with.
    pub(crate) fn buckets(&self) -> usize {
        self.buckets.len()
    }

    fn add_count(&mut self, bucket: i32, n: u64) -> Option<()> {
        match self.buckets.binary_search_by_key(&bucket, |&(b, _)| b) {
            Ok(i) => self.buckets[i].1 = self.buckets[i].1.checked_add(n)?,
            Err(i) => self.buckets.insert(i, (bucket, n)),
        }
        while self.buckets.len() > MAX_BUCKETS {
            self.fold_nearest_zero()?;
        }
        Some(())
    }

    /// Fold the non-zero bucket of smallest magnitude into the zero bucket.
    fn fold_nearest_zero(&mut self) -> Option<()> {
        let (i, _) = self
            .buckets
            .iter()
            .enumerate()
            .filter(|(_, (b, _))| *b != 0)
            .min_by_key(|(_, (b, _))| (b.unsigned_abs(), *b))?;
        let (_, n) = self.buckets.remove(i);
        match self.buckets.binary_search_by_key(&0, |&(b, _)| b) {
            Ok(z) => self.buckets[z].1 = self.buckets[z].1.checked_add(n)?,
            Err(z) => self.buckets.insert(z, (0, n)),
        }
        Some(())
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
        for &(b, c) in &self.buckets {
            seen += u128::from(c);
            if seen >= rank {
                return Some(bound_of(b));
            }
        }
        self.buckets.last().map(|&(b, _)| bound_of(b))
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
        let mut worst = s.clone();
        for b in &mut worst.buckets {
            b.1 = u64::MAX;
        }
        let bytes = postcard::to_stdvec(&worst).unwrap().len();
        assert!(17 * (bytes + 256) < 128 * 1024, "{bytes} bytes");
        // The largest values keep their accuracy; only those nearest zero were folded.
        let top = s.quantile(1000).unwrap();
        assert!(top > 3.9e15 * (1.0 - RELATIVE_ERROR) && top < 4.0e15);
    }

    #[test]
    fn an_overflowing_count_is_refused() {
        let mut s = Sketch::of(1.0);
        s.buckets[0].1 = u64::MAX;
        assert_eq!(s.insert(1.0), None);
        assert!(s.insert(2.0).is_some());
    }
}
