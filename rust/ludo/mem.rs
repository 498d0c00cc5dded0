//! Large index arrays on transparent huge pages.
//!
//! Lookups and writes hit random cache lines across tens of megabytes; with 4 KiB pages almost
//! every one of them also misses the TLB and pays a page walk. Large arrays are therefore mapped
//! directly (fresh anonymous memory, so no page is touched before the advice) and advised onto
//! 2 MiB pages (Linux `madvise(MADV_HUGEPAGE)`, effective when THP is "madvise" or "always").
//! Going through malloc would not do: glibc serves freed large blocks again from its heap, whose
//! pages are already faulted in as 4 KiB pages. Small arrays, other systems, or a failed map
//! fall back to an ordinary `Vec`, as does every array when `KVCOMPASS_NO_HUGEPAGES` is set
//! (for A/B measurements: on this VM huge pages cut writer latencies by 10-20%).

use std::ops::{Deref, DerefMut};

/// Arrays smaller than this stay on ordinary pages (the advice would not pay for itself).
const HUGE_MIN: usize = 4 << 20;
#[cfg(target_os = "linux")]
const BASE_PAGE: usize = 4 << 10;

/// Plain data whose all-zero bit pattern is a valid value (so fresh zero pages are a valid
/// array of it).
///
/// # Safety
/// Implement only for types made of integers, arrays and structs of them, with no padding
/// invariants.
pub(crate) unsafe trait Plain: Copy {}
// SAFETY: integers are valid at all-zero.
unsafe impl Plain for u8 {}
// SAFETY: integers are valid at all-zero.
unsafe impl Plain for u32 {}
// SAFETY: integers are valid at all-zero.
unsafe impl Plain for u64 {}

/// A fixed-length array of plain values, on huge pages when large.
///
/// `ptr` and `len` describe the values wherever they live (the mapping or the fallback `Vec`,
/// whose buffer never moves since nothing is ever pushed), so reading one is a plain slice
/// access with no test of which: the Ludo tables index these on every probe.
pub(crate) struct HugeBuf<T: Plain> {
    ptr: std::ptr::NonNull<T>,
    len: usize,
    /// `(start, bytes)` of the mapping, when mapped.
    mapped: Option<(std::ptr::NonNull<T>, usize)>,
    fallback: Vec<T>,
}

// SAFETY: HugeBuf owns its mapping exclusively, like a Vec<T>.
unsafe impl<T: Plain + Send> Send for HugeBuf<T> {}
// SAFETY: shared access only hands out &[T], like a Vec<T>.
unsafe impl<T: Plain + Sync> Sync for HugeBuf<T> {}

impl<T: Plain> HugeBuf<T> {
    /// `n` copies of `value`.
    pub(crate) fn filled(n: usize, value: T) -> Self {
        let bytes = n.saturating_mul(std::mem::size_of::<T>());
        if let Some(m) = Self::map(n, bytes) {
            let mut b = Self::on_map(m);
            // Fresh anonymous pages read as zero (a valid T, since T: Plain); only a non-zero
            // fill needs to touch them.
            // SAFETY: T is Plain (no padding), so its bytes can be read.
            let zero = unsafe { std::slice::from_raw_parts(&value as *const T as *const u8, std::mem::size_of::<T>()) }.iter().all(|&x| x == 0);
            if !zero {
                b.fill(value);
            }
            return b;
        }
        Self::on_vec(vec![value; n])
    }

    fn on_map((p, n, len): (std::ptr::NonNull<T>, usize, usize)) -> Self {
        HugeBuf { ptr: p, len: n, mapped: Some((p, len)), fallback: Vec::new() }
    }

    fn on_vec(mut v: Vec<T>) -> Self {
        // SAFETY: a Vec's pointer is never null (dangling but aligned when empty).
        let ptr = unsafe { std::ptr::NonNull::new_unchecked(v.as_mut_ptr()) };
        HugeBuf { ptr, len: v.len(), mapped: None, fallback: v }
    }

    #[cfg(target_os = "linux")]
    fn map(n: usize, bytes: usize) -> Option<(std::ptr::NonNull<T>, usize, usize)> {
        if bytes < HUGE_MIN || std::mem::align_of::<T>() > 4096 || std::env::var_os("KVCOMPASS_NO_HUGEPAGES").is_some() {
            return None;
        }
        // Whole base pages, not whole huge pages: the kernel backs the aligned 2 MiB extents
        // inside with huge pages either way, and a length rounded to 2 MiB left up to 2 MiB an
        // array resident and unaccounted (found in review: 38 % over the reported bytes at
        // half a million entries).
        let len = bytes.next_multiple_of(BASE_PAGE);
        // SAFETY: an anonymous private mapping with no address hint; the result is checked.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        if p == libc::MAP_FAILED {
            return None;
        }
        // SAFETY: the range is the mapping just created; the advice only changes its backing.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        std::ptr::NonNull::new(p as *mut T).map(|nn| (nn, n, len))
    }

    #[cfg(not(target_os = "linux"))]
    fn map(_n: usize, _bytes: usize) -> Option<(std::ptr::NonNull<T>, usize, usize)> {
        None
    }

    /// Bytes this buffer holds.
    pub(crate) fn bytes(&self) -> usize {
        match self.mapped {
            Some((_, len)) => len, // the whole mapping
            None => self.fallback.capacity() * std::mem::size_of::<T>(),
        }
    }
}

impl<T: Plain> Deref for HugeBuf<T> {
    type Target = [T];
    #[inline(always)]
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised (zero or filled) values of T for our lifetime,
        // in the mapping or in the fallback's buffer, which no method reallocates.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Plain> DerefMut for HugeBuf<T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in deref, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Plain> Drop for HugeBuf<T> {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if let Some((p, len)) = self.mapped.take() {
            // SAFETY: unmapping exactly the mapping this buffer created, once.
            unsafe { libc::munmap(p.as_ptr() as *mut libc::c_void, len) };
        }
    }
}

impl<T: Plain> Clone for HugeBuf<T> {
    fn clone(&self) -> Self {
        let bytes = self.len() * std::mem::size_of::<T>();
        match Self::map(self.len(), bytes) {
            Some(m) => {
                let mut b = Self::on_map(m);
                b.copy_from_slice(self);
                b
            }
            None => Self::on_vec(self.to_vec()),
        }
    }
}

impl<T: Plain + std::fmt::Debug> std::fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HugeBuf(len={}, huge={})", self.len(), self.mapped.is_some())
    }
}

/// For each of `lines` cache lines, the next one in a single random cycle through all of them
/// (Sattolo's shuffle): a pointer chase over it can never be predicted or cut short.
fn chase_cycle(lines: usize, seed: u64) -> Vec<u32> {
    let mut order: Vec<u32> = (0..lines as u32).collect();
    let mut x = seed | 1;
    for i in (1..lines).rev() {
        x = super::hash::mix64(x);
        order.swap(i, (x % i as u64) as usize);
    }
    let mut next = vec![0u32; lines];
    for i in 0..lines {
        next[order[i] as usize] = order[(i + 1) % lines];
    }
    next
}

/// Nanoseconds per dependent load over `bytes` of memory laid out as the index arrays are (on
/// huge pages when large): a chase through one random cycle over all the cache lines, so no load
/// can start before the one before it has returned. The machine's floor for anything that must
/// follow a pointer it has just read (a forest walk, a cuckoo path): it puts a host's writer
/// latencies in proportion, since this one number differs several times between machines.
pub fn dependent_load_ns(bytes: usize, steps: usize, seed: u64) -> f64 {
    const LINE: usize = 8; // u64 words a cache line
    let lines = (bytes / 64).max(2);
    let next = chase_cycle(lines, seed);
    let mut buf = HugeBuf::filled(lines * LINE, 0u64);
    for (i, &n) in next.iter().enumerate() {
        buf[i * LINE] = (n as usize * LINE) as u64;
    }
    drop(next);
    let mut p = 0usize;
    for _ in 0..lines.min(steps) {
        p = buf[p] as usize; // up to one lap of warm-up
    }
    let t = std::time::Instant::now();
    for _ in 0..steps {
        p = buf[p] as usize;
    }
    let ns = t.elapsed().as_nanos() as f64 / steps.max(1) as f64;
    std::hint::black_box(p);
    ns
}

#[cfg(test)]
mod tests {
    /// A mapped array is accounted as its whole mapping, and the mapping is whole base pages:
    /// no 2 MiB tail resident beyond what is reported (review, twenty-fifth session).
    #[test]
    fn a_mapped_array_reports_its_mapping() {
        let n = 600_000usize; // 4.8 MB of u64: past HUGE_MIN, not a whole number of pages
        let b = super::HugeBuf::<u64>::filled(n, 1);
        assert_eq!(b.len(), n);
        assert!(b.iter().all(|&x| x == 1));
        if b.mapped.is_some() {
            assert_eq!(b.bytes(), (n * 8).next_multiple_of(4096));
        } else {
            assert_eq!(b.bytes(), n * 8);
        }
    }

    /// The chase visits every line once per lap (a single cycle), whatever the seed.
    #[test]
    fn chase_is_one_cycle() {
        for seed in [1u64, 7, 99] {
            let lines = 1000;
            let next = super::chase_cycle(lines, seed);
            let (mut p, mut seen) = (0u32, vec![false; lines]);
            for _ in 0..lines {
                assert!(!seen[p as usize]);
                seen[p as usize] = true;
                p = next[p as usize];
            }
            assert_eq!(p, 0);
        }
        assert!(super::dependent_load_ns(1 << 20, 10_000, 3) > 0.0);
    }
}
