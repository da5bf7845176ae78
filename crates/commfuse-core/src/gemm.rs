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

/// The tile of the GPU GEMM kernel (`commfuse-cuda`'s `gemm.cu`): the fused schedules' default,
/// and the only tile the CUDA backend builds them with.
pub const KERNEL_TILE: TileShape = TileShape { m: 128, n: 256 };

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
    /// Where the row bands of tiles start, then M (`tiles_m + 1` entries, increasing, each
    /// band at most `tile.m` rows); `None`: bands of `tile.m` rows from row 0. Bands let tiles
    /// start where another rank's rows start, so that no tile straddles two owners (the fused
    /// reduce-scatter).
    pub bands: Option<Vec<usize>>,
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
            bands: None,
        }
    }

    /// Row bands × column tiles.
    pub fn tile_grid(&self) -> (usize, usize) {
        let (tm, tn) = tiles(&self.problem, self.tile);
        (self.bands.as_ref().map_or(tm, |b| b.len() - 1), tn)
    }

    pub fn tile_count(&self) -> usize {
        let (tm, tn) = self.tile_grid();
        tm * tn
    }

    /// Rows of band `i`.
    pub fn band_rows(&self, i: usize) -> std::ops::Range<usize> {
        match &self.bands {
            Some(b) => b[i]..b[i + 1],
            None => i * self.tile.m..((i + 1) * self.tile.m).min(self.problem.m),
        }
    }

    /// Rows and columns of tile `t` in D.
    pub fn tile_bounds(&self, t: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (_, tn) = self.tile_grid();
        let (i, j) = (t / tn, t % tn);
        let cols = j * self.tile.n..((j + 1) * self.tile.n).min(self.problem.n);
        (self.band_rows(i), cols)
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
        if self.tile.m == 0 || self.tile.n == 0 {
            return Err(Error::Unsupported("tile shape must be positive".into()));
        }
        if let Some(b) = &self.bands {
            let ok = b.len() >= 2
                && b[0] == 0
                && b[b.len() - 1] == self.problem.m
                && b.windows(2)
                    .all(|w| w[0] < w[1] && w[1] - w[0] <= self.tile.m);
            if !ok {
                return Err(Error::Unsupported(format!(
                    "row bands must rise from 0 to M = {} in steps of 1 to {} rows, got {b:?}",
                    self.problem.m, self.tile.m
                )));
            }
        }
        let count = self.tile_count();
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

/// A tile order for L2 reuse: bands of `group` tile rows, each walked column by column, so a
/// wave of a persistent grid shares a few A row panels and B column panels instead of sweeping
/// all of B. Any permutation is valid; this is the default of the GPU benchmarks.
pub fn grouped_order(problem: &GemmProblem, tile: TileShape, group: usize) -> Vec<usize> {
    let (tm, tn) = tiles(problem, tile);
    grouped_order_of_grid(tm, tn, group)
}

/// [`grouped_order`] over a grid of `tm` row bands × `tn` column tiles.
pub fn grouped_order_of_grid(tm: usize, tn: usize, group: usize) -> Vec<usize> {
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

/// Which tiles the blocks of one wave run side by side ([`tile_order`]), and so which of A's
/// row panels and B's column panels they ask L2 for at the same time: blocks on the SMs of
/// one GPC that read the same sectors together are served by one L2 read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TileOrder {
    /// [`grouped_order`]: bands of `group` tile rows, M fastest within a band
    #[default]
    Grouped,
    /// Row by row, N fastest
    Rows,
    /// Squares of [`SQUARE_TILES`] tiles (as many tile rows as M has up to 4, the rest in
    /// columns), one after the other, M fastest within each
    Squares,
    /// The same squares dealt out in turn: square s's j-th tile at place j·S + s of S squares,
    /// so that blocks S places apart share their panels
    DealtSquares,
}

/// Tiles in one square of [`TileOrder::Squares`] (about the SMs of one GPC).
pub const SQUARE_TILES: usize = 16;

impl TileOrder {
    /// Every order, the default first.
    pub const ALL: [TileOrder; 4] = [
        TileOrder::Grouped,
        TileOrder::Rows,
        TileOrder::Squares,
        TileOrder::DealtSquares,
    ];

    /// `grouped`, `rows`, `squares` or `dealt-squares`.
    pub fn name(self) -> &'static str {
        match self {
            TileOrder::Grouped => "grouped",
            TileOrder::Rows => "rows",
            TileOrder::Squares => "squares",
            TileOrder::DealtSquares => "dealt-squares",
        }
    }

    /// The order named `name` ([`TileOrder::name`]).
    pub fn from_name(name: &str) -> Option<TileOrder> {
        Self::ALL.into_iter().find(|o| o.name() == name)
    }
}

/// The tiles of a grid of `tm` × `tn` tiles in `order` (`group`: the band of
/// [`TileOrder::Grouped`]); every tile exactly once.
pub fn tile_order(tm: usize, tn: usize, order: TileOrder, group: usize) -> Vec<usize> {
    let squares = || {
        let side_m = tm.clamp(1, 4);
        let side_n = (SQUARE_TILES / side_m).max(1);
        let mut out: Vec<Vec<usize>> = Vec::new();
        for band in (0..tm).step_by(side_m) {
            for col in (0..tn).step_by(side_n) {
                let mut square = Vec::new();
                for j in col..(col + side_n).min(tn) {
                    for i in band..(band + side_m).min(tm) {
                        square.push(i * tn + j);
                    }
                }
                out.push(square);
            }
        }
        out
    };
    match order {
        TileOrder::Grouped => grouped_order_of_grid(tm, tn, group),
        TileOrder::Rows => (0..tm * tn).collect(),
        TileOrder::Squares => squares().concat(),
        TileOrder::DealtSquares => {
            let squares = squares();
            let longest = squares.iter().map(Vec::len).max().unwrap_or(0);
            (0..longest)
                .flat_map(|j| squares.iter().filter_map(move |sq| sq.get(j).copied()))
                .collect()
        }
    }
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

/// One element of D in float64 with the magnitudes its rounding errors scale with: what
/// [`element_bound`] needs to judge a computed element.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ReferenceElement {
    /// The exact result: alpha·Σₖ aᵢₖ·bₖⱼ (+ beta·cᵢⱼ) (+ biasⱼ) (+ the previous dᵢⱼ).
    pub value: f64,
    /// Σₖ |aᵢₖ·bₖⱼ|: the f32 accumulation's rounding errors are proportional to it.
    pub abs_products: f64,
    /// |alpha·Σₖ aᵢₖ·bₖⱼ| + |beta·cᵢⱼ| + |biasⱼ| + |previous dᵢⱼ|: the epilogue's f32 additions
    /// (and the first of an accumulating epilogue's two roundings) are proportional to it.
    pub abs_terms: f64,
}

impl ReferenceElement {
    /// An element of the plain product A·B (alpha 1, no other term).
    pub fn product(value: f64, abs_products: f64) -> ReferenceElement {
        ReferenceElement {
            value,
            abs_products,
            abs_terms: value.abs(),
        }
    }
}

/// A·B and |A|·|B| in float64 for A [m, k] (row-major) and B [k, n] in `layout`: the
/// operands widened once and multiplied by `matrixmultiply`'s blocked kernel. Products of
/// 16-bit values are exact in f64 and the sums' rounding (≈ K·2⁻⁵³ relative) is far below any
/// bound a check applies, so the order of the additions does not matter.
pub fn products_f64<T: crate::Element>(
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    b: &[T],
    layout: BLayout,
) -> (Vec<f64>, Vec<f64>) {
    let a: Vec<f64> = a[..m * k].iter().map(|x| x.to_f64()).collect();
    let b: Vec<f64> = b[..k * n].iter().map(|x| x.to_f64()).collect();
    let (row_stride, col_stride) = match layout {
        BLayout::KN => (n as isize, 1),
        BLayout::NK => (1, k as isize),
    };
    let product = |a: &[f64], b: &[f64]| {
        let mut c = vec![0f64; m * n];
        if m * n * k > 0 {
            // SAFETY: a is m × k with row stride k; b holds k × n elements read with the
            // strides of its layout (KN: [k][n], NK: [n][k]); c is m × n with row stride n
            unsafe {
                matrixmultiply::dgemm(
                    m,
                    k,
                    n,
                    1.0,
                    a.as_ptr(),
                    k as isize,
                    1,
                    b.as_ptr(),
                    row_stride,
                    col_stride,
                    0.0,
                    c.as_mut_ptr(),
                    n as isize,
                    1,
                );
            }
        }
        c
    };
    let abs = |v: &[f64]| v.iter().map(|x| x.abs()).collect::<Vec<f64>>();
    (product(&a, &b), product(&abs(&a), &abs(&b)))
}

/// D of one GEMM call in float64 from the operands as stored: alpha·A·B (+ beta·C) (+ bias)
/// (+ the destination's previous contents when the epilogue accumulates). C, bias and the
/// previous contents have the output type; each is needed only when the epilogue uses it.
/// The reference every GEMM implementation (CPU model, our kernel, cuBLASLt) is checked
/// against; at shapes too large for the CPU the GPU bench uses a float64 kernel validated
/// against this function.
pub fn reference_gemm<TI: crate::Element, TO: crate::Element>(
    p: &GemmProblem,
    e: &Epilogue,
    a: &[TI],
    b: &[TI],
    c: Option<&[TO]>,
    bias: Option<&[TO]>,
    previous: Option<&[TO]>,
) -> Vec<ReferenceElement> {
    let (m, n, k) = (p.m, p.n, p.k);
    let (dots, abs) = products_f64(m, n, k, a, b, p.b_layout);
    let element = |i: usize, j: usize| {
        let (dot, abs_products) = (dots[i * n + j], abs[i * n + j]);
        // the epilogue's terms, those it uses, in a fixed order
        let terms = [
            Some(e.alpha as f64 * dot),
            (e.beta != 0.0)
                .then(|| e.beta as f64 * c.expect("beta != 0 needs C")[i * n + j].to_f64()),
            e.bias
                .then(|| bias.expect("the epilogue adds a bias")[j].to_f64()),
            e.accumulate
                .then(|| previous.expect("accumulating needs the previous D")[i * n + j].to_f64()),
        ];
        ReferenceElement {
            value: terms.iter().flatten().sum(),
            abs_products,
            abs_terms: terms.iter().flatten().map(|t| t.abs()).sum(),
        }
    };
    (0..m * n).map(|x| element(x / n, x % n)).collect()
}

/// The margin of [`element_bound`] over the error model: a correct kernel stays below half the
/// bound, so that a true worst case an estimate misses by a little still passes.
pub const BOUND_MARGIN: f64 = 2.0;

/// f32 roundings in the epilogue after the accumulation: alpha·acc, + beta·c, + bias, + the
/// previous value (each at most one unit roundoff of a partial sum no larger than `abs_terms`).
const EPILOGUE_ROUNDINGS: f64 = 4.0;

/// The largest error a correct GEMM with f32 accumulation may make in one element of D:
///
/// ```text
/// |d − ref| ≤ 2 · ( √K·u₃₂·|alpha|·Σₖ|aᵢₖbₖⱼ|      accumulation in f32
///                 + 4·u₃₂·(|alpha·a·b| + |beta·c| + |bias| + |previous|)   epilogue in f32
///                 + u_out·|ref|  (+ u_out·terms when accumulating 16-bit)   cast(s) to the output
///                 + half the output type's smallest subnormal )
/// ```
///
/// with unit roundoffs u₃₂ = 2⁻²⁴, u_out = 2⁻⁸ (bf16), 2⁻¹¹ (f16), 2⁻²⁴ (f32).
///
/// Why these terms: the reference is computed from the operands as stored, and a product of two
/// bf16 or f16 values is exact in f32 (8 or 11 significant bits each, 24 in f32), so the inputs
/// contribute no rounding of their own. Summing K products in f32 rounds at most K times, each
/// error a unit roundoff of a partial sum no larger than Σ|ab|; the worst case K·u₃₂·Σ|ab| is
/// reached only if every rounding errs the same way, and at K = 24576 it would let a wrong
/// element through (≈ 9 on values of ≈ 50). Rounding errors of independent sums behave like
/// random signs, which gives √K·u₃₂·Σ|ab| (Higham and Mary, "A new approach to probabilistic
/// rounding error analysis", 2019) — and on inputs of random sign the partial sums, and with
/// them the real error, stay far below even that: at K = 8192 and f32 output, a sequential f32
/// sum of uniform [-1, 1) products reaches under 1 % of the bound, a sum of exact blocks of 16
/// added with truncation (how tensor cores are reported to round) under 4 % (see the tests).
/// At 16-bit outputs a correctly rounded result reaches just under half the bound.
///
/// What it catches: a swapped or shifted column or row (an error of the order of |ref|), a
/// missing k-block, and at f32 output a single extra or missing product aᵢₖbₖⱼ whenever that
/// product exceeds the bound (at K = 3584 and Σ|ab| ≈ K/4, about 96 % of products are above
/// it). At 16-bit outputs no bound can see an error below the output's own rounding.
pub fn element_bound(p: &GemmProblem, e: &Epilogue, want: &ReferenceElement) -> f64 {
    let u_f32 = DType::F32.unit_roundoff();
    let u_out = p.output.unit_roundoff();
    let accumulation = (p.k as f64).sqrt() * u_f32 * (e.alpha as f64).abs() * want.abs_products;
    let epilogue = EPILOGUE_ROUNDINGS * u_f32 * want.abs_terms;
    let mut output = u_out * want.value.abs();
    if e.accumulate && p.output != DType::F32 {
        // the tile is cast to the output type before the previous value is added, then cast
        // again: the first rounding is of a value no larger than the terms' magnitudes
        output += u_out * want.abs_terms;
    }
    let smallest_subnormal = match p.output {
        DType::F32 => f64::powi(2.0, -149),
        DType::BF16 => f64::powi(2.0, -133),
        DType::F16 => f64::powi(2.0, -24),
    };
    BOUND_MARGIN * (accumulation + epilogue + output + smallest_subnormal / 2.0)
}

/// The outcome of checking computed elements against [`element_bound`].
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ElementCheck {
    pub checked: usize,
    /// Elements whose error exceeds the bound (NaN included).
    pub out_of_bound: usize,
    /// The largest error / bound seen (∞ for NaN or infinite elements); below 1 means all pass.
    pub worst_ratio: f64,
    /// The element with the worst ratio: its index, the value computed, the reference and the
    /// bound.
    pub worst: Option<(usize, f64, f64, f64)>,
}

impl Default for ElementCheck {
    fn default() -> Self {
        ElementCheck {
            checked: 0,
            out_of_bound: 0,
            worst_ratio: 0.0,
            worst: None,
        }
    }
}

impl ElementCheck {
    /// Counts element `index`, computed as `got`, against its reference.
    pub fn add(
        &mut self,
        p: &GemmProblem,
        e: &Epilogue,
        index: usize,
        got: f64,
        want: &ReferenceElement,
    ) {
        self.add_bounded(index, got, want.value, element_bound(p, e, want));
    }

    /// Counts element `index`, computed as `got`, against `want` within `bound` (for checks
    /// whose bound is not one GEMM's, e.g. a fused operator's).
    pub fn add_bounded(&mut self, index: usize, got: f64, want: f64, bound: f64) {
        let error = (got - want).abs();
        // NaN and infinities compare false: they are out of bound with the worst ratio
        let ratio = if error <= f64::MAX {
            error / bound
        } else {
            f64::INFINITY
        };
        self.checked += 1;
        // written so that NaN counts: `error > bound` is false for it
        let within = error <= bound;
        if !within {
            self.out_of_bound += 1;
        }
        if self.worst.is_none() || ratio > self.worst_ratio {
            self.worst_ratio = ratio;
            self.worst = Some((index, got, want, bound));
        }
    }

    /// The check of the union of two disjoint sets of elements (parallel checks merge).
    pub fn merge(self, other: ElementCheck) -> ElementCheck {
        let worse = if other.worst.is_some()
            && (self.worst.is_none() || other.worst_ratio > self.worst_ratio)
        {
            other
        } else {
            self
        };
        ElementCheck {
            checked: self.checked + other.checked,
            out_of_bound: self.out_of_bound + other.out_of_bound,
            ..worse
        }
    }

    pub fn passed(&self) -> bool {
        self.out_of_bound == 0
    }
}

impl std::fmt::Display for ElementCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} elements out of bound, worst error {:.3} × the bound",
            self.out_of_bound, self.checked, self.worst_ratio
        )?;
        if let Some((index, got, want, bound)) = self.worst {
            write!(
                f,
                " at element {index} (got {got:e}, want {want:e} ± {bound:.3e})"
            )?;
        }
        Ok(())
    }
}

/// Checks every computed element (in D's order) against its reference with [`element_bound`].
pub fn check_elements(
    p: &GemmProblem,
    e: &Epilogue,
    got: impl IntoIterator<Item = f64>,
    want: &[ReferenceElement],
) -> ElementCheck {
    let mut check = ElementCheck::default();
    let mut count = 0;
    for (index, (g, w)) in got.into_iter().zip(want).enumerate() {
        check.add(p, e, index, g, w);
        count += 1;
    }
    assert_eq!(
        count,
        want.len(),
        "one computed element per reference element"
    );
    check
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
    fn every_tile_order_is_a_permutation_and_squares_share_panels() {
        for (tm, tn) in [(1, 1), (1, 64), (4, 32), (3, 7), (2, 64), (5, 9), (64, 64)] {
            for order in TileOrder::ALL {
                let o = tile_order(tm, tn, order, 8);
                let mut seen = o.clone();
                seen.sort_unstable();
                assert_eq!(
                    seen,
                    (0..tm * tn).collect::<Vec<_>>(),
                    "{order:?} {tm}x{tn}"
                );
            }
        }
        // 4 × 32 tiles: each run of 16 places of the squares (and every 8th place of the dealt
        // squares) reads 4 row panels and 4 column panels
        let panels = |tiles: &[usize]| {
            let rows: std::collections::BTreeSet<_> = tiles.iter().map(|t| t / 32).collect();
            let cols: std::collections::BTreeSet<_> = tiles.iter().map(|t| t % 32).collect();
            (rows.len(), cols.len())
        };
        let sq = tile_order(4, 32, TileOrder::Squares, 8);
        for run in sq.chunks(16) {
            assert_eq!(panels(run), (4, 4));
        }
        let dealt = tile_order(4, 32, TileOrder::DealtSquares, 8);
        for s in 0..8 {
            let every_8th: Vec<usize> = dealt.iter().skip(s).step_by(8).copied().collect();
            assert_eq!(panels(&every_8th), (4, 4));
        }
        assert_eq!(tile_order(2, 3, TileOrder::Rows, 8), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(
            tile_order(2, 3, TileOrder::Grouped, 8),
            vec![0, 3, 1, 4, 2, 5]
        );
        assert_eq!(
            TileOrder::from_name("dealt-squares"),
            Some(TileOrder::DealtSquares)
        );
        assert_eq!(TileOrder::from_name("diagonal"), None);
    }
    use half::{bf16, f16};

    /// Uniform in [-1, 1) from a splitmix stream.
    fn uniform(seed: u64, len: usize) -> Vec<f32> {
        let mut x = seed;
        (0..len)
            .map(|_| {
                x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = x;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn operands<T: crate::Element>(p: &GemmProblem, seed: u64) -> (Vec<T>, Vec<T>) {
        let cast = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect();
        (
            cast(uniform(seed, p.m * p.k)),
            cast(uniform(seed + 1, p.k * p.n)),
        )
    }

    /// f32 rounded toward zero: how tensor cores are reported to round their sums.
    fn truncate(x: f64) -> f32 {
        let r = x as f32;
        if (r as f64).abs() > x.abs() {
            f32::from_bits(r.to_bits() - 1)
        } else {
            r
        }
    }

    /// What correct kernels compute: the products summed in f32 either one by one with
    /// rounding (the CPU model) or in exact blocks of 16 added with truncation (a tensor-core
    /// model), then alpha, beta·C and bias in f32 and one cast to the output type.
    fn f32_gemm<TI: crate::Element, TO: crate::Element>(
        p: &GemmProblem,
        e: &Epilogue,
        a: &[TI],
        b: &[TI],
        c: &[TO],
        bias: &[TO],
        blocked: bool,
    ) -> Vec<f64> {
        let mut d = Vec::with_capacity(p.m * p.n);
        for i in 0..p.m {
            for j in 0..p.n {
                let product = |kk: usize| {
                    let bv = match p.b_layout {
                        BLayout::KN => b[kk * p.n + j],
                        BLayout::NK => b[j * p.k + kk],
                    };
                    a[i * p.k + kk].to_f32() * bv.to_f32()
                };
                let mut acc = 0f32;
                if blocked {
                    for block in (0..p.k).step_by(16) {
                        let part: f64 = (block..(block + 16).min(p.k))
                            .map(|kk| product(kk) as f64)
                            .sum();
                        acc = truncate(acc as f64 + part);
                    }
                } else {
                    for kk in 0..p.k {
                        acc += product(kk);
                    }
                }
                let mut v = e.alpha * acc;
                if e.beta != 0.0 {
                    v += e.beta * c[i * p.n + j].to_f32();
                }
                if e.bias {
                    v += bias[j].to_f32();
                }
                d.push(TO::from_f32(v).to_f64());
            }
        }
        d
    }

    fn correct_results_pass<TI: crate::Element, TO: crate::Element>(
        m: usize,
        n: usize,
        k: usize,
    ) -> f64 {
        let mut worst: f64 = 0.0;
        for (layout, e) in [
            (BLayout::NK, Epilogue::default()),
            (
                BLayout::KN,
                Epilogue {
                    alpha: 0.5,
                    beta: -0.75,
                    bias: true,
                    accumulate: false,
                },
            ),
        ] {
            let p = GemmProblem::new(m, n, k, layout, TI::DTYPE, TO::DTYPE).unwrap();
            let (a, b) = operands::<TI>(&p, k as u64);
            let c: Vec<TO> = uniform(3, m * n).into_iter().map(TO::from_f32).collect();
            let bias: Vec<TO> = uniform(4, n).into_iter().map(TO::from_f32).collect();
            let want = reference_gemm(&p, &e, &a, &b, Some(&c), Some(&bias), None);
            for blocked in [false, true] {
                let got = f32_gemm(&p, &e, &a, &b, &c, &bias, blocked);
                let check = check_elements(&p, &e, got, &want);
                assert!(
                    check.passed() && check.worst_ratio < 1.0 / BOUND_MARGIN,
                    "{m}×{n}×{k} {layout:?} {}→{} blocked {blocked}: {check}",
                    p.input,
                    p.output
                );
                worst = worst.max(check.worst_ratio);
            }
        }
        worst
    }

    #[test]
    fn correct_f32_accumulation_stays_within_half_the_bound() {
        for k in [8, 136, 1032] {
            correct_results_pass::<bf16, f32>(9, 7, k);
            correct_results_pass::<bf16, bf16>(9, 7, k);
            correct_results_pass::<f16, f16>(9, 7, k);
            correct_results_pass::<f16, f32>(9, 7, k);
        }
        // long K at f32 output, where only the accumulation term counts: the real error uses a
        // small part of it (it scales with the partial sums, ≈ √K smaller than Σ|ab|)
        let worst = correct_results_pass::<bf16, f32>(4, 6, 8192);
        assert!(worst < 0.05, "worst ratio {worst}");
    }

    #[test]
    fn a_single_wrong_element_fails() {
        let p = GemmProblem::new(16, 24, 3584, BLayout::NK, DType::BF16, DType::F32).unwrap();
        let e = Epilogue::default();
        let (a, b) = operands::<bf16>(&p, 11);
        let want = reference_gemm::<bf16, f32>(&p, &e, &a, &b, None, None, None);
        let correct = f32_gemm::<bf16, f32>(&p, &e, &a, &b, &[], &[], false);
        assert!(check_elements(&p, &e, correct.clone(), &want).passed());
        let product =
            |i: usize, j: usize, kk: usize| a[i * p.k + kk].to_f64() * b[j * p.k + kk].to_f64();
        // one element with one product too many: every element, each with its own largest
        // product counted twice, is caught on its own
        for idx in 0..p.m * p.n {
            let (i, j) = (idx / p.n, idx % p.n);
            let extra = (0..p.k)
                .map(|kk| product(i, j, kk))
                .max_by(|x, y| x.abs().total_cmp(&y.abs()))
                .unwrap();
            let mut got = correct.clone();
            got[idx] += extra;
            let check = check_elements(&p, &e, got, &want);
            assert_eq!(check.out_of_bound, 1, "{check}");
            assert_eq!(check.worst.unwrap().0, idx);
        }
        // a loop that stops one product early (k < K − 1): nearly every element fails
        let short: Vec<f64> = correct
            .iter()
            .enumerate()
            .map(|(idx, d)| d - product(idx / p.n, idx % p.n, p.k - 1))
            .collect();
        let check = check_elements(&p, &e, short, &want);
        assert!(check.out_of_bound * 100 >= 90 * check.checked, "{check}");
        // two columns swapped, at bf16 output
        let p16 = GemmProblem {
            output: DType::BF16,
            ..p
        };
        let mut got = f32_gemm::<bf16, bf16>(&p16, &e, &a, &b, &[], &[], false);
        assert!(check_elements(&p16, &e, got.clone(), &want).passed());
        for i in 0..p.m {
            got.swap(i * p.n + 5, i * p.n + 6);
        }
        let check = check_elements(&p16, &e, got.clone(), &want);
        assert_eq!(check.out_of_bound, 2 * p.m, "{check}");
        // an unwritten (poisoned) element
        got = correct.clone();
        got[7] = f64::NAN;
        let check = check_elements(&p, &e, got, &want);
        assert_eq!((check.out_of_bound, check.worst_ratio), (1, f64::INFINITY));
        assert!(
            check
                .to_string()
                .starts_with("1 of 384 elements out of bound"),
            "{check}"
        );
    }

    #[test]
    fn checks_of_disjoint_parts_merge_into_the_whole() {
        let p = GemmProblem::new(8, 8, 64, BLayout::KN, DType::F16, DType::F16).unwrap();
        let e = Epilogue::default();
        let (a, b) = operands::<f16>(&p, 5);
        let want = reference_gemm::<f16, f16>(&p, &e, &a, &b, None, None, None);
        let mut got = f32_gemm::<f16, f16>(&p, &e, &a, &b, &[], &[], false);
        got[3] += 1.0;
        got[40] -= 2.0;
        let whole = check_elements(&p, &e, got.clone(), &want);
        let mut parts = [ElementCheck::default(), ElementCheck::default()];
        for (idx, (g, w)) in got.iter().zip(&want).enumerate() {
            parts[idx % 2].add(&p, &e, idx, *g, w);
        }
        assert_eq!(parts[0].merge(parts[1]), whole);
        assert_eq!(parts[1].merge(parts[0]), whole);
        assert_eq!((whole.out_of_bound, whole.worst.unwrap().0), (2, 40));
    }

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
