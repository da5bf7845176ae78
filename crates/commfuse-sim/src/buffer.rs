//! Symmetric buffers: the same-size, zero-initialised allocation on every rank, which any rank
//! may read or write. Access from rank threads is `unsafe`: ordering it is the job of the
//! signal protocol, and the plan checker proves that a plan's accesses are ordered.

use commfuse_core::backend::BackendError;
use commfuse_core::Element;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ops::Range;
use std::ptr::NonNull;

struct Allocation<T> {
    ptr: NonNull<T>,
    len: usize,
    /// Whether this process allocated it (else it lies in a group's shared arena)
    owned: bool,
}

impl<T> Drop for Allocation<T> {
    fn drop(&mut self) {
        if self.owned && self.len > 0 {
            // SAFETY: allocated in `SymmetricBuffer::new` with this layout
            unsafe {
                dealloc(
                    self.ptr.as_ptr().cast(),
                    Layout::array::<T>(self.len).unwrap(),
                )
            }
        }
    }
}

/// Asks the kernel to back a large, still untouched allocation with 2 MiB pages: a simulated
/// 16 Mi-element all-reduce over 8 ranks touches over a GiB, and with 4 KiB pages the first
/// touches cost more than the collective itself. Advice only; failure changes nothing.
fn prefer_huge_pages(ptr: *mut u8, bytes: usize) {
    const HUGE: usize = 2 << 20;
    if bytes < 2 * HUGE {
        return;
    }
    let start = (ptr as usize).next_multiple_of(HUGE);
    let end = (ptr as usize + bytes) / HUGE * HUGE;
    if end > start {
        #[cfg(target_os = "linux")]
        // SAFETY: the range lies inside an allocation we own; madvise only changes paging
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

/// `len` elements of `T` on each of `world` ranks.
pub struct SymmetricBuffer<T: Element> {
    ranks: Vec<Allocation<T>>,
    len: usize,
    /// The shared memory the copies lie in, for a buffer of a multi-process group
    _arena: Option<std::sync::Arc<crate::shared::Arena>>,
}

// SAFETY: the buffer owns plain-old-data memory; concurrent access goes through unsafe methods
// whose callers order it.
unsafe impl<T: Element> Send for SymmetricBuffer<T> {}
unsafe impl<T: Element> Sync for SymmetricBuffer<T> {}

impl<T: Element> SymmetricBuffer<T> {
    /// Allocates zeroed memory (the OS maps it lazily, so untouched scratch costs nothing).
    pub fn new(world: usize, len: usize) -> Result<Self, BackendError> {
        let layout = Layout::array::<T>(len).map_err(|_| {
            BackendError::Unavailable(format!("a buffer of {len} elements overflows"))
        })?;
        let mut ranks = Vec::with_capacity(world);
        for _ in 0..world {
            let ptr = if len == 0 {
                NonNull::dangling()
            } else {
                // SAFETY: layout has non-zero size
                let raw = unsafe { alloc_zeroed(layout) };
                let ptr = NonNull::new(raw.cast::<T>()).ok_or_else(|| {
                    BackendError::Unavailable(format!(
                        "out of memory allocating {} bytes",
                        layout.size()
                    ))
                })?;
                prefer_huge_pages(raw, layout.size());
                ptr
            };
            ranks.push(Allocation {
                ptr,
                len,
                owned: true,
            });
        }
        Ok(SymmetricBuffer {
            ranks,
            len,
            _arena: None,
        })
    }

    /// A buffer of `world`: in this process's memory, or for a shared world (one rank of a
    /// multi-process group) every rank's copy carved from the group's shared memory, at the
    /// same place in every process.
    pub fn new_in(world: &crate::World, len: usize) -> Result<Self, BackendError> {
        let Some(arena) = world.arena() else {
            return SymmetricBuffer::new(world.size(), len);
        };
        let bytes = Layout::array::<T>(len)
            .map_err(|_| {
                BackendError::Unavailable(format!("a buffer of {len} elements overflows"))
            })?
            .size();
        let ranks = (0..world.size())
            .map(|_| {
                let raw = arena.alloc(bytes.max(1))?;
                Ok(Allocation {
                    ptr: NonNull::new(raw.cast::<T>()).expect("inside a mapping"),
                    len,
                    owned: false,
                })
            })
            .collect::<Result<_, BackendError>>()?;
        Ok(SymmetricBuffer {
            ranks,
            len,
            _arena: Some(arena.clone()),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// Rank `rank`'s copy, for the host between calls.
    pub fn local(&mut self, rank: usize) -> &[T] {
        // SAFETY: &mut self excludes every other access
        unsafe { std::slice::from_raw_parts(self.ranks[rank].ptr.as_ptr(), self.len) }
    }

    /// Rank `rank`'s copy, mutable, for the host between calls.
    pub fn local_mut(&mut self, rank: usize) -> &mut [T] {
        // SAFETY: &mut self excludes every other access
        unsafe { std::slice::from_raw_parts_mut(self.ranks[rank].ptr.as_ptr(), self.len) }
    }

    /// Rank `rank`'s copy, shared, when no call is running.
    pub fn view(&self, rank: usize) -> &[T] {
        // SAFETY: the backend only hands out `&self` views while no rank thread runs
        unsafe { std::slice::from_raw_parts(self.ranks[rank].ptr.as_ptr(), self.len) }
    }

    /// A raw pointer to element `range.start` of rank `rank`'s copy.
    ///
    /// # Panics
    /// If the range lies outside the buffer.
    pub fn ptr(&self, rank: usize, range: Range<usize>) -> *mut T {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range {range:?} outside a buffer of {}",
            self.len
        );
        // SAFETY: in bounds, checked above
        unsafe { self.ranks[rank].ptr.as_ptr().add(range.start) }
    }

    /// Copies `src` into rank `rank`'s copy at `offset` (a store, local or to a peer).
    ///
    /// # Safety
    /// No other thread may access the destination range concurrently: order conflicting
    /// accesses with notify/wait.
    pub unsafe fn store(&self, rank: usize, offset: usize, src: &[T]) {
        let dst = self.ptr(rank, offset..offset + src.len());
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
    }

    /// Copies `dst.len()` elements of rank `rank`'s copy from `offset` (a load).
    ///
    /// # Safety
    /// No other thread may write the source range concurrently.
    pub unsafe fn load(&self, rank: usize, offset: usize, dst: &mut [T]) {
        let src = self.ptr(rank, offset..offset + dst.len());
        std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len());
    }
}
