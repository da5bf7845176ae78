//! The contract of commfuse's GEMM with a programmable epilogue, shared by the CPU model (in
//! commfuse-sim) and the GPU kernel: the problem, the tile grid, the order in which a
//! persistent grid visits tiles, where each finished tile goes (local output or a peer's
//! symmetric buffer, with its own leading dimension), and the flag raised after a tile is
//! visible at its destination. The fused operators (GEMM+reduce-scatter, all-gather+GEMM) are
//! built from these pieces: they order tiles remote-first and point their destinations into
//! the owner's reduce buffer.

use crate::dtype::DType;
use crate::error::Error;
use crate::plan::{NotifyOp, Slot};

/// How B is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum BLayout {
    /// B is [K, N], row-major.
    KN,
    /// B is [N, K], row-major (weights stored transposed).
    NK,
}

/// D[M, N] = alpha · A[M, K] · B + beta · C[M, N] (+ bias[N]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct GemmProblem {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub b_layout: BLayout,
    /// bf16 or f16
    pub input: DType,
    /// bf16, f16 or f32
    pub output: DType,
}

impl GemmProblem {
    pub fn new(
        m: usize,
        n: usize,
        k: usize,
        b_layout: BLayout,
        input: DType,
        output: DType,
    ) -> Result<Self, Error> {
        if m == 0 || n == 0 || k == 0 {
            return Err(Error::Unsupported(format!(
                "GEMM sizes must be positive, got M={m} N={n} K={k}"
            )));
        }
        if !k.is_multiple_of(8) {
            return Err(Error::Unsupported(format!(
                "K must be a multiple of 8 (rows of A and B are loaded 16 bytes at a time), got K={k}"
            )));
        }
        if input == DType::F32 {
            return Err(Error::Unsupported("GEMM inputs are bf16 or f16".into()));
        }
        m.checked_mul(k)
            .and(n.checked_mul(k))
            .and(m.checked_mul(n))
            .ok_or_else(|| Error::SizeOverflow(format!("GEMM {m}×{n}×{k}")))?;
        Ok(GemmProblem {
            m,
            n,
            k,
            b_layout,
            input,
            output,
        })
    }

    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

/// Output tile shape; tiles at the right and bottom edges are cut short (ragged M and N).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct TileShape {
    pub m: usize,
    pub n: usize,
}

/// Where one tile's rows go: element (i, j) of the tile lands at `offset + i · ld + j` of the
/// output buffer of rank `rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Destination {
    pub rank: usize,
    pub offset: usize,
    pub ld: usize,
}

/// Raised on the destination's rank after the tile's stores are visible there (release,
/// system scope on GPUs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct TileFlag {
    pub slot: Slot,
    pub value: u64,
    pub op: NotifyOp,
}

/// The epilogue, applied per tile in f32 before the cast to the output type.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Epilogue {
    pub alpha: f32,
    pub beta: f32,
    pub bias: bool,
    /// Add the result to what the destination holds instead of overwriting it. Not atomic:
    /// destinations of tiles that may run at once must not overlap.
    pub accumulate: bool,
}

impl Default for Epilogue {
    fn default() -> Self {
        Epilogue {
            alpha: 1.0,
            beta: 0.0,
            bias: false,
            accumulate: false,
        }
    }
}

/// One GEMM call of one rank: problem, tiles, order, destinations, flags, epilogue.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GemmPlan {
    pub problem: GemmProblem,
    pub tile: TileShape,
    /// The order a persistent grid takes tiles in (tile t = tm · tiles_n + tn).
    pub order: Vec<usize>,
    /// Per tile; `None` everywhere means the local output, row-major with ld = N.
    pub destinations: Option<Vec<Destination>>,
    /// Per tile, the flag raised after its stores (none: no flags).
    pub flags: Option<Vec<TileFlag>>,
    pub epilogue: Epilogue,
}

impl GemmPlan {
    /// Row-major tile order, local destinations, no flags.
    pub fn local(problem: GemmProblem, tile: TileShape, epilogue: Epilogue) -> GemmPlan {
        let count = tiles(&problem, tile).0 * tiles(&problem, tile).1;
        GemmPlan {
            problem,
            tile,
            order: (0..count).collect(),
            destinations: None,
            flags: None,
            epilogue,
        }
    }

    pub fn tile_count(&self) -> usize {
        let (tm, tn) = tiles(&self.problem, self.tile);
        tm * tn
    }

    /// Rows and columns of tile `t` in D.
    pub fn tile_bounds(&self, t: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (_, tn) = tiles(&self.problem, self.tile);
        let (i, j) = (t / tn, t % tn);
        let rows = i * self.tile.m..((i + 1) * self.tile.m).min(self.problem.m);
        let cols = j * self.tile.n..((j + 1) * self.tile.n).min(self.problem.n);
        (rows, cols)
    }

    /// Where tile `t` goes on rank `me`.
    pub fn destination(&self, t: usize, me: usize) -> Destination {
        match &self.destinations {
            Some(d) => d[t],
            None => {
                let (rows, cols) = self.tile_bounds(t);
                Destination {
                    rank: me,
                    offset: rows.start * self.problem.n + cols.start,
                    ld: self.problem.n,
                }
            }
        }
    }

    /// Keeps every tile at its own place in D (row-major, ld = N) but on rank `rank_of(t)`, and
    /// with `flag = Some((row, op))` raises slot (row, t) there by 1 (Set or Add) after the
    /// tile; `None` drops the flags. The routing of a GEMM whose output rows belong to other
    /// ranks' buffers.
    pub fn route_in_place(
        &mut self,
        rank_of: impl Fn(usize) -> usize,
        flag: Option<(u32, NotifyOp)>,
    ) {
        let n = self.problem.n;
        let tiles = 0..self.tile_count();
        self.destinations = Some(
            tiles
                .clone()
                .map(|t| {
                    let (rows, cols) = self.tile_bounds(t);
                    Destination {
                        rank: rank_of(t),
                        offset: rows.start * n + cols.start,
                        ld: n,
                    }
                })
                .collect(),
        );
        self.flags = flag.map(|(row, op)| {
            tiles
                .map(|t| TileFlag {
                    slot: Slot::new(row, t as u32),
                    value: 1,
                    op,
                })
                .collect()
        });
    }

    /// Checks the order is a permutation of all tiles and the tables have one entry per tile.
    pub fn validate(&self, world: usize) -> Result<(), Error> {
        let count = self.tile_count();
        if self.tile.m == 0 || self.tile.n == 0 {
            return Err(Error::Unsupported("tile shape must be positive".into()));
        }
        let mut seen = vec![false; count];
        if self.order.len() != count {
            return Err(Error::Unsupported(format!(
                "the tile order lists {} tiles, the problem has {count}",
                self.order.len()
            )));
        }
        for &t in &self.order {
            if t >= count || std::mem::replace(&mut seen[t], true) {
                return Err(Error::Unsupported(format!(
                    "the tile order names tile {t} twice or out of range (0..{count})"
                )));
            }
        }
        for (name, len) in [
            ("destination", self.destinations.as_ref().map(|d| d.len())),
            ("flag", self.flags.as_ref().map(|f| f.len())),
        ] {
            if let Some(len) = len {
                if len != count {
                    return Err(Error::Unsupported(format!(
                        "the {name} table has {len} entries for {count} tiles"
                    )));
                }
            }
        }
        if let Some(d) = self
            .destinations
            .as_ref()
            .and_then(|d| d.iter().find(|d| d.rank >= world))
        {
            return Err(Error::Unsupported(format!(
                "a tile goes to rank {}, the world has {world}",
                d.rank
            )));
        }
        Ok(())
    }
}

/// Element (i, j) of A·B in float64, from the operands as stored: the reference every GEMM
/// implementation (CPU model, our kernel, cuBLASLt) is checked against.
pub fn reference_dot<T: crate::Element>(
    p: &GemmProblem,
    a: &[T],
    b: &[T],
    i: usize,
    j: usize,
) -> f64 {
    (0..p.k)
        .map(|kk| {
            let bv = match p.b_layout {
                BLayout::KN => b[kk * p.n + j],
                BLayout::NK => b[j * p.k + kk],
            };
            a[i * p.k + kk].to_f64() * bv.to_f64()
        })
        .sum()
}

/// A tile order for L2 reuse: bands of `group` tile rows, each walked column by column, so a
/// wave of a persistent grid shares a few A row panels and B column panels instead of sweeping
/// all of B. Any permutation is valid; this is the default of the GPU benchmarks.
pub fn grouped_order(problem: &GemmProblem, tile: TileShape, group: usize) -> Vec<usize> {
    let (tm, tn) = tiles(problem, tile);
    let group = group.max(1);
    let mut order = Vec::with_capacity(tm * tn);
    for band in (0..tm).step_by(group) {
        for j in 0..tn {
            for i in band..(band + group).min(tm) {
                order.push(i * tn + j);
            }
        }
    }
    order
}

/// The fused operators' tile order: tiles bound for other ranks spread evenly over the run
/// (so NVLink carries a steady share of every wave instead of a burst), and the last
/// `last_wave` places — the final wave of a persistent grid, whose stores nothing can overlap —
/// given to local tiles. `base` is the order to keep within each class (e.g. [`grouped_order`]).
pub fn staggered_remote_first(
    base: &[usize],
    is_remote: impl Fn(usize) -> bool,
    last_wave: usize,
) -> Vec<usize> {
    let remote: Vec<usize> = base.iter().copied().filter(|&t| is_remote(t)).collect();
    let local: Vec<usize> = base.iter().copied().filter(|&t| !is_remote(t)).collect();
    let tail = last_wave.min(local.len());
    let (head, tail) = local.split_at(local.len() - tail);
    let mut order = Vec::with_capacity(base.len());
    // merge remote and head-local tiles in proportion: after placing i tiles, about
    // i · |remote| / (|remote| + |head|) of them are remote
    let total = remote.len() + head.len();
    let (mut r, mut h) = (0, 0);
    for i in 0..total {
        if r < remote.len() && (h == head.len() || (r * total) <= i * remote.len()) {
            order.push(remote[r]);
            r += 1;
        } else {
            order.push(head[h]);
            h += 1;
        }
    }
    order.extend_from_slice(tail);
    order
}

/// D of one GEMM call in float64 from the operands as stored: alpha·A·B (+ beta·C) (+ bias)
/// (+ the destination's previous contents when the epilogue accumulates). C, bias and the
/// previous contents have the output type; each is needed only when the epilogue uses it.
pub fn reference_gemm<TI: crate::Element, TO: crate::Element>(
    p: &GemmProblem,
    e: &Epilogue,
    a: &[TI],
    b: &[TI],
    c: Option<&[TO]>,
    bias: Option<&[TO]>,
    previous: Option<&[TO]>,
) -> Vec<f64> {
    let mut d = vec![0f64; p.m * p.n];
    for i in 0..p.m {
        for j in 0..p.n {
            let mut v = e.alpha as f64 * reference_dot(p, a, b, i, j);
            if e.beta != 0.0 {
                v += e.beta as f64 * c.expect("beta != 0 needs C")[i * p.n + j].to_f64();
            }
            if e.bias {
                v += bias.expect("the epilogue adds a bias")[j].to_f64();
            }
            if e.accumulate {
                v += previous.expect("accumulating needs the previous D")[i * p.n + j].to_f64();
            }
            d[i * p.n + j] = v;
        }
    }
    d
}

/// ‖got − want‖ / ‖want‖ (Frobenius). A NaN in `got` (an unwritten, poisoned element) makes
/// the result NaN, which fails every bound.
pub fn relative_error(got: impl IntoIterator<Item = f64>, want: &[f64]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.into_iter().zip(want) {
        num += (g - w).powi(2);
        den += w * w;
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// Tiles along M and N.
pub fn tiles(problem: &GemmProblem, tile: TileShape) -> (usize, usize) {
    (
        problem.m.div_ceil(tile.m.max(1)),
        problem.n.div_ceil(tile.n.max(1)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ragged_tiles_cover_the_output_once() {
        let p = GemmProblem::new(37, 53, 16, BLayout::KN, DType::BF16, DType::F32).unwrap();
        let mut plan = GemmPlan::local(p, TileShape { m: 16, n: 32 }, Epilogue::default());
        assert_eq!(plan.tile_count(), 3 * 2);
        let mut covered = vec![0; 37 * 53];
        for t in 0..plan.tile_count() {
            let (rows, cols) = plan.tile_bounds(t);
            for i in rows {
                for j in cols.clone() {
                    covered[i * 53 + j] += 1;
                }
            }
        }
        assert!(covered.iter().all(|&c| c == 1));
        plan.validate(1).unwrap();
        // routed in place: same offsets and ld as the local output, on the named rank
        let local: Vec<Destination> = (0..6).map(|t| plan.destination(t, 0)).collect();
        plan.route_in_place(|t| t % 2, Some((2, NotifyOp::Add)));
        for (t, l) in local.iter().enumerate() {
            assert_eq!(plan.destination(t, 0), Destination { rank: t % 2, ..*l });
            let f = plan.flags.as_ref().unwrap()[t];
            assert_eq!(
                (f.slot, f.value, f.op),
                (Slot::new(2, t as u32), 1, NotifyOp::Add)
            );
        }
        plan.validate(2).unwrap();
        plan.route_in_place(|_| 1, None);
        assert!(plan.flags.is_none());
    }

    #[test]
    fn bad_problems_and_tables_are_refused() {
        let err = GemmProblem::new(8, 8, 12, BLayout::NK, DType::BF16, DType::BF16).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("K must be a multiple of 8") && msg.ends_with("got K=12"),
            "{msg}"
        );
        assert!(GemmProblem::new(0, 8, 8, BLayout::KN, DType::F16, DType::F16).is_err());
        assert!(GemmProblem::new(8, 8, 8, BLayout::KN, DType::F32, DType::F32).is_err());
        let p = GemmProblem::new(32, 32, 8, BLayout::KN, DType::BF16, DType::F32).unwrap();
        let mut plan = GemmPlan::local(p, TileShape { m: 16, n: 16 }, Epilogue::default());
        plan.order = vec![0, 1, 1, 3];
        assert!(plan
            .validate(1)
            .unwrap_err()
            .to_string()
            .contains("tile 1 twice"));
        plan.order = vec![3, 2, 1, 0];
        plan.validate(1).unwrap();
        plan.order = grouped_order(&p, plan.tile, 3);
        assert_eq!(plan.order, vec![0, 2, 1, 3]);
        plan.validate(1).unwrap();
        // tiles 0 and 1 remote: spread over the head, the last wave of two local
        plan.order = staggered_remote_first(&[0, 1, 2, 3], |t| t < 2, 2);
        assert_eq!(plan.order, vec![0, 1, 2, 3]);
        plan.validate(1).unwrap();
        plan.destinations = Some(vec![
            Destination {
                rank: 2,
                offset: 0,
                ld: 32
            };
            4
        ]);
        assert!(plan.validate(2).unwrap_err().to_string().contains("rank 2"));
    }

    #[test]
    fn staggered_order_spreads_remote_tiles_and_ends_local() {
        for (tiles, remote_every, last_wave) in [(100, 2, 13), (37, 3, 40), (64, 1, 8), (9, 5, 0)] {
            let base: Vec<usize> = (0..tiles).rev().collect();
            let is_remote = |t: usize| t.is_multiple_of(remote_every);
            let order = staggered_remote_first(&base, is_remote, last_wave);
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..tiles).collect::<Vec<_>>(), "a permutation");
            let locals = (0..tiles).filter(|&t| !is_remote(t)).count();
            let tail = last_wave.min(locals);
            assert!(order[tiles - tail..].iter().all(|&t| !is_remote(t)));
            // within the head, remote tiles never bunch up: gaps stay near the even spacing
            let head = &order[..tiles - tail];
            let remote = head.iter().filter(|&&t| is_remote(t)).count();
            if remote > 0 && remote < head.len() {
                let spacing = head.len().div_ceil(remote);
                let mut run = 0;
                for &t in head {
                    run = if is_remote(t) { run + 1 } else { 0 };
                    assert!(run <= spacing.max(remote.div_ceil(head.len() - remote) + 1));
                }
            }
            // the base order is kept within each class
            let r: Vec<usize> = order.iter().copied().filter(|&t| is_remote(t)).collect();
            assert!(r.windows(2).all(|w| w[0] > w[1]));
        }
    }
}
