//! Symbolic memory for the plan checker: each buffer is a sorted list of segments; a segment
//! holds a symbolic value (which ranks' inputs, which elements, from which call) and who last
//! wrote and read it. Plans move whole chunks, so the number of segments depends on the plan's
//! structure, not on the element count: a plan for 16 Mi elements checks as fast as one for 16.

use std::ops::Range;

/// A symbolic value: the reduction over the ranks in `mask` of their input elements
/// `elem, elem+1, …` (affine along the segment), written by the host in call `call`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Val {
    Uninit,
    Sym { mask: u64, elem: usize, call: u32 },
}

impl Val {
    pub(crate) fn shift(self, by: usize) -> Val {
        match self {
            Val::Uninit => Val::Uninit,
            Val::Sym { mask, elem, call } => Val::Sym {
                mask,
                elem: elem + by,
                call,
            },
        }
    }

    fn continues(self, len: usize, next: Val) -> bool {
        match (self, next) {
            (Val::Uninit, Val::Uninit) => true,
            (Val::Sym { mask, elem, call }, Val::Sym { .. }) => {
                next == Val::Sym {
                    mask,
                    elem: elem + len,
                    call,
                }
            }
            _ => false,
        }
    }
}

/// Who touched memory: a rank at one of its steps (or its caller, between calls), and that
/// rank's own vector-clock component at the time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Access {
    pub rank: usize,
    pub at: Where,
    pub time: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Where {
    Step {
        step: usize,
        call: usize,
    },
    /// The rank's caller before the call: it writes its whole input and output.
    CallerBefore(usize),
    /// The rank's caller after the call: it reads its whole output.
    CallerAfter(usize),
}

impl std::fmt::Display for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.at {
            Where::Step { step, call } => {
                write!(f, "rank {} step {} (call {})", self.rank, step, call)
            }
            Where::CallerBefore(c) => write!(f, "rank {}'s caller before call {}", self.rank, c),
            Where::CallerAfter(c) => write!(f, "rank {}'s caller after call {}", self.rank, c),
        }
    }
}

#[derive(Debug, Clone)]
struct Cell {
    val: Val,
    writer: Option<Access>,
    readers: Vec<Access>,
}

#[derive(Debug, Clone)]
struct Seg {
    start: usize,
    end: usize,
    cell: Cell,
}

/// A value over `len` consecutive elements, with the access that wrote it.
pub(crate) type Piece = (usize, Val, Option<Access>);

/// An access that conflicts with the current one and is not ordered before it.
pub(crate) enum Conflict {
    Write(Access),
    Read(Access),
}

pub(crate) struct SegMap {
    len: usize,
    segs: Vec<Seg>,
}

impl SegMap {
    pub(crate) fn new(len: usize) -> Self {
        let segs = if len == 0 {
            Vec::new()
        } else {
            vec![Seg {
                start: 0,
                end: len,
                cell: Cell {
                    val: Val::Uninit,
                    writer: None,
                    readers: Vec::new(),
                },
            }]
        };
        SegMap { len, segs }
    }

    fn find(&self, x: usize) -> usize {
        self.segs.partition_point(|s| s.end <= x)
    }

    fn split(&mut self, x: usize) {
        if x == 0 || x >= self.len {
            return;
        }
        let i = self.find(x);
        let seg = &self.segs[i];
        if seg.start == x {
            return;
        }
        let mut tail = seg.clone();
        tail.cell.val = seg.cell.val.shift(x - seg.start);
        tail.start = x;
        self.segs[i].end = x;
        self.segs.insert(i + 1, tail);
    }

    fn span(&mut self, range: &Range<usize>) -> Range<usize> {
        if range.is_empty() {
            return 0..0;
        }
        self.split(range.start);
        self.split(range.end);
        self.find(range.start)..self.segs.partition_point(|s| s.start < range.end)
    }

    /// Reads `range` as `access`; fails with the first earlier write not ordered before it.
    pub(crate) fn read(
        &mut self,
        range: Range<usize>,
        access: Access,
        ordered: &dyn Fn(&Access) -> bool,
    ) -> Result<Vec<Piece>, Conflict> {
        let span = self.span(&range);
        let mut out = Vec::with_capacity(span.len());
        for seg in &mut self.segs[span] {
            if let Some(w) = seg.cell.writer {
                if !ordered(&w) {
                    return Err(Conflict::Write(w));
                }
            }
            seg.cell.readers.retain(|a| a.rank != access.rank);
            seg.cell.readers.push(access);
            out.push((seg.end - seg.start, seg.cell.val, seg.cell.writer));
        }
        Ok(out)
    }

    /// Writes `vals` (lengths summing to the range's) over `range` as `access`; fails with the
    /// first earlier read or write not ordered before it.
    pub(crate) fn write(
        &mut self,
        range: Range<usize>,
        vals: &[(usize, Val)],
        access: Access,
        ordered: &dyn Fn(&Access) -> bool,
    ) -> Result<(), Conflict> {
        let span = self.span(&range);
        for seg in &self.segs[span.clone()] {
            if let Some(w) = seg.cell.writer {
                if !ordered(&w) {
                    return Err(Conflict::Write(w));
                }
            }
            if let Some(r) = seg.cell.readers.iter().find(|r| !ordered(r)) {
                return Err(Conflict::Read(*r));
            }
        }
        let mut start = range.start;
        let fresh: Vec<Seg> = vals
            .iter()
            .filter(|(len, _)| *len > 0)
            .map(|&(len, val)| {
                let seg = Seg {
                    start,
                    end: start + len,
                    cell: Cell {
                        val,
                        writer: Some(access),
                        readers: Vec::new(),
                    },
                };
                start += len;
                seg
            })
            .collect();
        debug_assert_eq!(start, range.end);
        let first = span.start;
        let count = fresh.len();
        self.segs.splice(span, fresh);
        self.coalesce(first.saturating_sub(1)..(first + count + 1).min(self.segs.len()));
        Ok(())
    }

    /// Merges neighbours in `range` (segment indices) that carry one affine value from the same
    /// write and no reads, so that repeated calls do not fragment memory.
    fn coalesce(&mut self, range: Range<usize>) {
        let mut i = range.start;
        let mut end = range.end;
        while i + 1 < end {
            let (a, b) = (&self.segs[i], &self.segs[i + 1]);
            let same = a.cell.writer == b.cell.writer
                && a.cell.readers.is_empty()
                && b.cell.readers.is_empty()
                && a.cell.val.continues(a.end - a.start, b.cell.val);
            if same {
                self.segs[i].end = self.segs[i + 1].end;
                self.segs.remove(i + 1);
                end -= 1;
            } else {
                i += 1;
            }
        }
    }
}

/// Walks several piece lists of equal total length in lock step, calling `f` with the length
/// of each common run and the value of every list over it.
pub(crate) fn zip_pieces<E>(
    lists: &[Vec<Piece>],
    mut f: impl FnMut(usize, &[Val]) -> Result<(), E>,
) -> Result<(), E> {
    let mut idx = vec![0usize; lists.len()];
    let mut used = vec![0usize; lists.len()];
    let mut vals = vec![Val::Uninit; lists.len()];
    loop {
        let mut run = usize::MAX;
        for (k, list) in lists.iter().enumerate() {
            match list.get(idx[k]) {
                Some(&(len, _, _)) => run = run.min(len - used[k]),
                None => return Ok(()),
            }
        }
        for (k, list) in lists.iter().enumerate() {
            vals[k] = list[idx[k]].1.shift(used[k]);
        }
        f(run, &vals)?;
        for (k, list) in lists.iter().enumerate() {
            used[k] += run;
            if used[k] == list[idx[k]].0 {
                idx[k] += 1;
                used[k] = 0;
            }
        }
    }
}
