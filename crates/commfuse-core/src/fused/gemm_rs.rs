//! GEMM + reduce-scatter, the row-parallel linear layer of tensor parallelism (the semantics of
//! Flux's GemmRS and PyTorch's `fused_matmul_reduce_scatter`): rank r holds A_r [M, K] and B_r
//! ([K, N] or [N, K]); rank o's output is chunk o of the rows of Σ_r A_r·B_r (+ bias, added
//! once), chunks split as the collectives split M (the first M mod P chunks one row longer).
//!
//! The schedule, for every rank:
//! * Tiles are 128 × 256 (the GPU kernel's), in row bands that start at every chunk boundary,
//!   so no tile straddles two owners.
//! * Rank r computes its tiles owner by owner, starting with rank r+1's and ending with its own
//!   (staggered: at any time the P ranks store into P different peers), each owner's tiles in
//!   the same grouped order on every sender, which is the order the owner reduces them in.
//! * A tile of owner o's chunk goes into o's receive buffer, slot `slot_of(r, o)` (the peers
//!   after o take slots 0 .. P − 2, o's own partial the last; rows relative to the chunk,
//!   ld = N), and then sets flag (slot, index of the tile among o's) on o to the call's number.
//! * The owner waits, tile by tile, until all P flags hold at least its call's number, and sums
//!   the P partials in f32 (the simulator in rank order; the GPU folds the peers' partials into
//!   the accumulators of its own tile, computed last), adds the bias, and writes its output.
//!   Flags are never cleared: an earlier call's flag holds a smaller number, whatever its M.
//! * When M < P, ranks that own no rows also wait for every peer (column 0 of each slot), so
//!   that no rank runs two calls ahead of a peer.
//!
//! Receive buffers and flags come in two sets used by alternate calls: a rank starts storing
//! into a peer's set of call c + 2 only after its own call c + 1 has finished, which needs the
//! peer's partials of call c + 1, which the peer makes only after its call c has finished
//! reading that set. So back-to-back calls need no other synchronisation.
//!
//! Cost card (per rank, per call, E = element size of the output type): (P−1)/P·M·N·E bytes
//! stored to peers and as many received; P·M/P·N·E bytes of partials read by the reduction;
//! one flag per tile per sender.

use crate::dtype::DType;
use crate::error::Error;
use crate::gemm::{
    grouped_order_of_grid, BLayout, Destination, ElementCheck, Epilogue, GemmPlan, GemmProblem,
    TileFlag, TileShape, BOUND_MARGIN, KERNEL_TILE,
};
use crate::op::chunk_range;
use crate::plan::{NotifyOp, Slot};
use std::ops::Range;
use std::time::Duration;

/// Tile rows the schedule groups together when walking an owner's tiles (L2 reuse of B).
pub const ORDER_GROUP: usize = 8;

/// What one GEMM + reduce-scatter call computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct GemmRsShape {
    pub world: usize,
    /// Rows of every rank's A (and of the full product)
    pub m: usize,
    pub n: usize,
    /// K of every rank's A and B (the reduction dimension of one rank's shard)
    pub k: usize,
    pub b_layout: BLayout,
    /// bf16 or f16
    pub input: DType,
    /// The partials' and the output's type: the input type or f32
    pub output: DType,
}

impl GemmRsShape {
    pub fn new(
        world: usize,
        m: usize,
        n: usize,
        k: usize,
        b_layout: BLayout,
        input: DType,
        output: DType,
    ) -> Result<GemmRsShape, Error> {
        super::check_shape(
            "GEMM + reduce-scatter",
            world,
            (m, n, k),
            b_layout,
            input,
            output,
        )?;
        Ok(GemmRsShape {
            world,
            m,
            n,
            k,
            b_layout,
            input,
            output,
        })
    }

    /// Every rank's GEMM: the full [M, N] partial product.
    pub fn problem(&self) -> GemmProblem {
        GemmProblem {
            m: self.m,
            n: self.n,
            k: self.k,
            b_layout: self.b_layout,
            input: self.input,
            output: self.output,
        }
    }

    /// Rows of the product owned by rank `owner`.
    pub fn chunk(&self, owner: usize) -> Range<usize> {
        chunk_range(self.m, self.world, owner)
    }

    /// Rows of the longest chunk (the first one).
    pub fn chunk_rows_max(&self) -> usize {
        self.m.div_ceil(self.world)
    }
}

/// Which way a GEMM + reduce-scatter call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum GemmRsPath {
    /// Our GEMM, its epilogue storing each tile into its owner's buffer (this module's schedule)
    Fused,
    /// The ring of library GEMMs whose running sums are handed on while the next piece is
    /// computed, each step cut into this many row pieces ([`super::ring_rs`])
    Overlapped { pieces: usize },
    /// The library GEMM of the whole product, then a reduce-scatter of it (no overlap): where
    /// the reduce-scatter is too short for either path to hide it profitably
    Unfused,
}

impl std::fmt::Display for GemmRsPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GemmRsPath::Fused => write!(f, "fused"),
            GemmRsPath::Overlapped { pieces: 1 } => write!(f, "overlapped (1 piece)"),
            GemmRsPath::Overlapped { pieces } => write!(f, "overlapped ({pieces} pieces)"),
            GemmRsPath::Unfused => write!(f, "unfused"),
        }
    }
}

/// Which way the calls of an operator run: one path always, or per call what
/// [`choose_path`] picks for its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum PathChoice {
    Auto,
    Always(GemmRsPath),
}

/// How the owner of a chunk sums the P partials of its rows on the fused path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Reduction {
    /// In the epilogue of its own tiles (computed last), on every SM
    Fold,
    /// In a separate kernel of this many blocks beside the GEMM (which keeps the other SMs)
    Separate { blocks: u32 },
}

/// What a GEMM + reduce-scatter operator is built for, on either backend: every call has this
/// N, K, layout and types and any M from 1 to `max_m` (the same M on every rank of a call).
/// The group it runs on gives the world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmRsConfig {
    /// The largest M of any call (the receive buffers and flag rows are sized for it)
    pub max_m: usize,
    pub n: usize,
    /// K of each rank's shard
    pub k: usize,
    pub b_layout: BLayout,
    /// bf16 or f16
    pub input: DType,
    /// The input type or f32
    pub output: DType,
    /// Whether calls add a bias [N] (in the output type), once
    pub bias: bool,
    /// Which path calls take
    pub path: PathChoice,
    /// How the owner sums the partials on the fused path
    pub reduction: Reduction,
    /// NUMA groups of consecutive ranks the overlapped path's ring crosses as few times as it
    /// can (1: one flat ring; see [`super::ring_rs`])
    pub numa_groups: usize,
    /// Output tile of the fused path's GEMM: [`KERNEL_TILE`], or 128 × 192 on the CUDA
    /// backend's wide ping-pong build (16-bit outputs of the input's type, N a multiple of 8;
    /// also where `COMMFUSE_GEMM_VARIANT=ping-pong-wide` names that build). The simulator also
    /// takes others, to test the schedule on small shapes; the CUDA backend refuses them where
    /// the fused path may run.
    pub tile: TileShape,
    /// How long any wait of a call may last before the call fails with a diagnosis: the CUDA
    /// operator's waits on the device and the host; on the simulator, the waits of a world
    /// whose configuration the operator's `world_config` made
    pub timeout: Duration,
}

impl GemmRsConfig {
    /// The defaults for a shape: no bias, the path [`choose_path`] picks per M, partials folded
    /// into the epilogue, one flat ring, the kernel's tile, 5 s waits.
    pub fn new(
        max_m: usize,
        n: usize,
        k: usize,
        b_layout: BLayout,
        input: DType,
        output: DType,
    ) -> GemmRsConfig {
        GemmRsConfig {
            max_m,
            n,
            k,
            b_layout,
            input,
            output,
            bias: false,
            path: PathChoice::Auto,
            reduction: Reduction::Fold,
            numa_groups: 1,
            tile: KERNEL_TILE,
            timeout: Duration::from_secs(5),
        }
    }

    /// The shape of a call of `m` rows on `world` ranks (validated).
    pub fn shape(&self, world: usize, m: usize) -> Result<GemmRsShape, Error> {
        GemmRsShape::new(
            world,
            m,
            self.n,
            self.k,
            self.b_layout,
            self.input,
            self.output,
        )
    }

    /// The path a call of `shape` takes: the one chosen, or [`choose_path`]'s.
    pub fn path_for(&self, shape: &GemmRsShape) -> GemmRsPath {
        match self.path {
            PathChoice::Always(path) => path,
            PathChoice::Auto => choose_path(shape),
        }
    }
}

/// Rows below which a step of the overlapped path is not cut in two.
pub const PIECE_ROWS_MIN: usize = 128;

/// Bytes a rank sends in the reduce-scatter below which `auto` takes the unfused path.
/// Measured on 2 × H200 (CHANGELOG.md, "GEMM + reduce-scatter's unfused path"): at 512×4096×4096 (2 MiB sent per rank)
/// cuBLASLt then NCCL took 52.6 µs, the overlapped ring 66.9 µs (1 piece) and 83.4 µs (2) —
/// its flag kernels and copy-engine start-up cost some 30 µs a call, more than the
/// reduce-scatter it hides (25 µs); at 1024×8192×3584 (8 MiB) the ring already won (1.12×).
pub const UNFUSED_BELOW_BYTES: usize = 4 << 20;

/// The path the cost model takes for `shape`: unfused where the reduce-scatter each rank sends
/// is under [`UNFUSED_BELOW_BYTES`]; else the overlapped ring wherever its rows are whole
/// 16-byte units (cuBLASLt's pieces start on row boundaries), the fused path otherwise. The
/// ring's steps are cut in two pieces when each keeps at least [`PIECE_ROWS_MIN`] rows: on
/// 2 × H200 two pieces measured fastest at every larger shape tried (M×N×K =
/// 8192×8192×3584, 2048×8192×3584, 8192×8192×14336, 1024×8192×3584; 1, 2, 4 and 8 pieces,
/// docs/results/gemm-rs/): more pieces give cuBLASLt GEMMs too small to run at full speed, one piece
/// leaves the first hand-on exposed. The fused path measured slower than the overlapped one
/// at every shape (our GEMM trails cuBLASLt's by 10–15 % at K = 3584). A pure function of the
/// shape, so every rank of a group picks the same.
pub fn choose_path(shape: &GemmRsShape) -> GemmRsPath {
    let sent = (shape.world - 1) * shape.chunk_rows_max() * shape.n * shape.output.size();
    if sent < UNFUSED_BELOW_BYTES {
        return GemmRsPath::Unfused;
    }
    choose_overlapping_path(shape)
}

/// [`choose_path`]'s choice between the two paths that overlap the reduce-scatter with the
/// GEMM, for a shape of any size (and where the unfused path cannot run).
pub fn choose_overlapping_path(shape: &GemmRsShape) -> GemmRsPath {
    if !(shape.n * shape.output.size()).is_multiple_of(16) {
        return GemmRsPath::Fused;
    }
    let pieces = if shape.chunk_rows_max() >= 2 * PIECE_ROWS_MIN {
        2
    } else {
        1
    };
    GemmRsPath::Overlapped { pieces }
}

/// Why a path's name and pieces name no path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathNameError {
    /// Not one of auto, fused, overlapped, unfused
    Unknown(String),
    /// Pieces given with a path other than overlapped
    PiecesWithoutOverlapped,
}

/// The path that a path's name ("auto", "fused", "overlapped", "unfused") and an optional
/// number of pieces ask for, the one vocabulary of the command line and the Python package:
/// `None` for "auto" (the caller takes [`choose_path`] for each call's shape), and for
/// "overlapped" without pieces the pieces "auto" would take for `shape`
/// ([`choose_overlapping_path`]), so that naming the path changes nothing else.
pub fn parse_path(
    name: &str,
    pieces: Option<usize>,
    shape: &GemmRsShape,
) -> Result<Option<GemmRsPath>, PathNameError> {
    let auto_pieces = match choose_overlapping_path(shape) {
        GemmRsPath::Overlapped { pieces } => pieces,
        GemmRsPath::Fused | GemmRsPath::Unfused => 1,
    };
    match (name, pieces) {
        ("auto", None) => Ok(None),
        ("fused", None) => Ok(Some(GemmRsPath::Fused)),
        ("unfused", None) => Ok(Some(GemmRsPath::Unfused)),
        ("overlapped", p) => Ok(Some(GemmRsPath::Overlapped {
            pieces: p.unwrap_or(auto_pieces),
        })),
        ("auto" | "fused" | "unfused", Some(_)) => Err(PathNameError::PiecesWithoutOverlapped),
        (other, _) => Err(PathNameError::Unknown(other.to_string())),
    }
}

impl std::fmt::Display for PathNameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathNameError::Unknown(name) => {
                write!(
                    f,
                    "unknown path {name:?}: auto, fused, overlapped or unfused"
                )
            }
            PathNameError::PiecesWithoutOverlapped => {
                write!(f, "pieces go with the overlapped path only")
            }
        }
    }
}

/// The tile grid, orders, destinations and flags of one shape.
#[derive(Debug, Clone, PartialEq)]
pub struct GemmRsSchedule {
    pub shape: GemmRsShape,
    pub tile: TileShape,
    /// Band starts, then M: every chunk starts a band, bands hold at most `tile.m` rows.
    pub bands: Vec<usize>,
    /// Column tiles per band.
    pub tiles_n: usize,
    /// Per owner: its tiles in the order every sender computes them and the owner reduces them.
    pub owner_tiles: Vec<Vec<usize>>,
    /// Per tile: its owner and its index in the owner's list (the flag's column).
    pub placement: Vec<(usize, usize)>,
    /// Elements of one receive slot (one sender's partial of the longest chunk of the largest
    /// M the buffers were made for).
    pub slot_len: usize,
    /// Flag columns per sender (the most tiles an owner has at that largest M).
    pub flag_stride: usize,
}

impl GemmRsSchedule {
    /// The schedule of `shape` laid out in buffers made for `shape` itself.
    pub fn new(shape: GemmRsShape, tile: TileShape) -> GemmRsSchedule {
        GemmRsSchedule::within(shape, shape.m, tile)
    }

    /// The schedule of `shape` laid out in receive buffers and flag rows made for `max_m` rows
    /// (`max_m` ≥ M): calls of any M up to it share one set of buffers and flag slots.
    pub fn within(shape: GemmRsShape, max_m: usize, tile: TileShape) -> GemmRsSchedule {
        let largest = GemmRsShape {
            m: max_m.max(shape.m),
            ..shape
        };
        let mut sched = GemmRsSchedule::grid(shape, tile);
        let layout = GemmRsSchedule::grid(largest, tile);
        sched.slot_len = largest.chunk_rows_max() * shape.n;
        sched.flag_stride = layout.tiles_per_owner_max();
        sched
    }

    fn grid(shape: GemmRsShape, tile: TileShape) -> GemmRsSchedule {
        let mut bands = Vec::new();
        let mut band_owner = Vec::new();
        for owner in 0..shape.world {
            let rows = shape.chunk(owner);
            let mut start = rows.start;
            while start < rows.end {
                bands.push(start);
                band_owner.push(owner);
                start = (start + tile.m).min(rows.end);
            }
        }
        bands.push(shape.m);
        let tiles_n = shape.n.div_ceil(tile.n);
        let mut owner_tiles = vec![Vec::new(); shape.world];
        let mut placement = vec![(0, 0); band_owner.len() * tiles_n];
        for (owner, tiles) in owner_tiles.iter_mut().enumerate() {
            let first = band_owner.iter().position(|&o| o == owner);
            let count = band_owner.iter().filter(|&&o| o == owner).count();
            if let Some(first) = first {
                for local in grouped_order_of_grid(count, tiles_n, ORDER_GROUP) {
                    let t = first * tiles_n + local;
                    placement[t] = (owner, tiles.len());
                    tiles.push(t);
                }
            }
        }
        GemmRsSchedule {
            slot_len: shape.chunk_rows_max() * shape.n,
            flag_stride: 0,
            shape,
            tile,
            bands,
            tiles_n,
            owner_tiles,
            placement,
        }
    }

    pub fn tile_count(&self) -> usize {
        self.placement.len()
    }

    /// Rows and columns of tile `t` in the product.
    pub fn tile_bounds(&self, t: usize) -> (Range<usize>, Range<usize>) {
        let (band, col) = (t / self.tiles_n, t % self.tiles_n);
        let cols = col * self.tile.n..((col + 1) * self.tile.n).min(self.shape.n);
        (self.bands[band]..self.bands[band + 1], cols)
    }

    /// The most tiles any owner has.
    pub fn tiles_per_owner_max(&self) -> usize {
        self.owner_tiles.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Flag slots of one set on every rank: one row of `world · flag_stride` columns.
    pub fn flag_columns(&self) -> usize {
        self.shape.world * self.flag_stride
    }

    /// Owner `owner`'s tiles as (rows relative to its chunk, columns), in reduction order.
    pub fn reduce_tiles(&self, owner: usize) -> Vec<(Range<usize>, Range<usize>)> {
        let start = self.shape.chunk(owner).start;
        self.owner_tiles[owner]
            .iter()
            .map(|&t| {
                let (rows, cols) = self.tile_bounds(t);
                (rows.start - start..rows.end - start, cols)
            })
            .collect()
    }

    /// Rank `rank`'s tile order: rank + 1's tiles, rank + 2's, ..., its own last.
    pub fn order(&self, rank: usize) -> Vec<usize> {
        let p = self.shape.world;
        (1..=p)
            .flat_map(|s| self.owner_tiles[(rank + s) % p].iter().copied())
            .collect()
    }

    /// The receive slot (and flag row block) of `sender`'s partials on `owner`: the peers after
    /// the owner in rank order take slots 0, 1, ..., P − 2 and the owner's own partial the last,
    /// so that the peers' partials lie at one stride from slot 0 (a GPU epilogue adds them in
    /// one loop).
    pub fn slot_of(&self, sender: usize, owner: usize) -> usize {
        let p = self.shape.world;
        (sender + p - owner - 1) % p
    }

    /// Where rank `sender`'s tile `t` goes: its owner's receive buffer, slot
    /// [`GemmRsSchedule::slot_of`] of set `set` (0 or 1, alternate calls), rows relative to the
    /// owner's chunk, ld = N.
    pub fn destination(&self, sender: usize, t: usize, set: usize) -> Destination {
        let (owner, _) = self.placement[t];
        let (rows, cols) = self.tile_bounds(t);
        let row = rows.start - self.shape.chunk(owner).start;
        Destination {
            rank: owner,
            offset: (set * self.shape.world + self.slot_of(sender, owner)) * self.slot_len
                + row * self.shape.n
                + cols.start,
            ld: self.shape.n,
        }
    }

    /// The flag rank `sender` sets on the owner of tile `t` in call `call` (from 1; set
    /// `(call − 1) mod 2`): row set, column slot_of(sender, owner) · flag_stride + the tile's
    /// index among the owner's tiles, set to the call's number. The owner waits for at least
    /// its call's number, so a flag never needs clearing, whatever M each call had.
    pub fn flag(&self, sender: usize, t: usize, call: u64) -> TileFlag {
        let (owner, index) = self.placement[t];
        TileFlag {
            slot: Slot::new(
                Self::set_of(call) as u32,
                (self.slot_of(sender, owner) * self.flag_stride + index) as u32,
            ),
            value: call,
            op: NotifyOp::Set,
        }
    }

    /// The set of receive slots and flag rows call `call` (from 1) uses: alternate calls take
    /// alternate sets.
    pub fn set_of(call: u64) -> usize {
        ((call.max(1) - 1) % 2) as usize
    }

    /// The schedule as a plan for the checker: the operator is a reduce-scatter of the ranks'
    /// partial products (rank r's input is its [M, N] partial, row-major), so the checker can
    /// prove of the fused schedule what it proves of every collective: no deadlock, no flag
    /// used twice in a call, no read of a tile before its flag, no receive slot overwritten
    /// while its owner may still read it, and every output element exactly the sum it should
    /// be. A tile's computation is modelled as copies of its rows into the owner's receive slot
    /// followed by its flag; the owner folds the peers' slots and its own partial into its
    /// output tile after waiting for their flags. One plan holds two calls (set 0, then set 1),
    /// so the checker's two consecutive runs cover the sets' alternation across four calls.
    /// The checker's reduce-scatter splits M·N evenly: M must be a multiple of P.
    pub fn plan(&self) -> Result<crate::plan::Plan, Error> {
        use crate::op::{OpKind, OpSpec};
        use crate::plan::{BufferKind, PlanBuilder, Region};
        let (p, n) = (self.shape.world, self.shape.n);
        if !self.shape.m.is_multiple_of(p) {
            return Err(Error::Unsupported(format!(
                "the checker sees GEMM + reduce-scatter as a reduce-scatter of M·N elements split evenly: M = {} must be a multiple of P = {p}",
                self.shape.m
            )));
        }
        let spec = OpSpec::new(OpKind::ReduceScatter, p, self.shape.m * n, 0)?;
        let mut b = PlanBuilder::new(spec);
        let flag_row = b.rows(2);
        let receive = b.scratch(2 * p * self.slot_len);
        for set in 0..2 {
            for rank in 0..p {
                // this rank's GEMM: every peer's tile into its receive slot, then its flag
                for t in self.order(rank) {
                    let (owner, index) = self.placement[t];
                    if owner == rank {
                        continue;
                    }
                    let (rows, cols) = self.tile_bounds(t);
                    let d = self.destination(rank, t, set);
                    for (i, row) in rows.enumerate() {
                        let src = Region::new(
                            rank,
                            BufferKind::Input,
                            row * n + cols.start..row * n + cols.end,
                        );
                        let at = receive + d.offset + i * d.ld;
                        let dst = Region::new(owner, BufferKind::Scratch, at..at + cols.len());
                        b.copy(rank, src, dst);
                    }
                    let col = (self.slot_of(rank, owner) * self.flag_stride + index) as u32;
                    b.signal(rank, owner, Slot::new(flag_row + set as u32, col));
                }
                // its own tiles: wait for the peers' partials, add them to its own
                let start = self.shape.chunk(rank).start;
                for (index, &t) in self.owner_tiles[rank].iter().enumerate() {
                    for q in (0..p).filter(|&q| q != rank) {
                        let col = (self.slot_of(q, rank) * self.flag_stride + index) as u32;
                        b.wait(rank, Slot::new(flag_row + set as u32, col), 1);
                    }
                    let (rows, cols) = self.tile_bounds(t);
                    for row in rows {
                        let mut srcs = vec![Region::new(
                            rank,
                            BufferKind::Input,
                            row * n + cols.start..row * n + cols.end,
                        )];
                        for q in (0..p).filter(|&q| q != rank) {
                            let slot = (set * p + self.slot_of(q, rank)) * self.slot_len;
                            let at = receive + slot + (row - start) * n + cols.start;
                            srcs.push(Region::new(rank, BufferKind::Scratch, at..at + cols.len()));
                        }
                        let out = (row - start) * n;
                        let dst =
                            Region::new(rank, BufferKind::Output, out + cols.start..out + cols.end);
                        b.reduce(rank, srcs, dst);
                    }
                }
            }
        }
        Ok(b.finish("gemm-rs"))
    }

    /// Rank `rank`'s GEMM in call `call` (from 1): the whole partial product, every tile routed
    /// to its owner's receive slot of the call's set, with its flag.
    pub fn gemm_plan(&self, rank: usize, call: u64) -> GemmPlan {
        let count = self.tile_count();
        let set = Self::set_of(call);
        GemmPlan {
            problem: self.shape.problem(),
            tile: self.tile,
            order: self.order(rank),
            destinations: Some((0..count).map(|t| self.destination(rank, t, set)).collect()),
            flags: Some((0..count).map(|t| self.flag(rank, t, call)).collect()),
            epilogue: Epilogue::default(),
            bands: Some(self.bands.clone()),
        }
    }
}

/// Random operands of a run of calls: per call, every rank's A [M, K] and B, and the bias (the
/// same on every rank, as a replicated parameter is), uniform in [-1, 1) from `seed` by the
/// project's indexable stream ([`crate::reference::input_value`]), so that one seed gives the
/// same operands on every backend.
pub struct CallInputs<TI, TO> {
    /// `a[call][rank]`
    pub a: Vec<Vec<Vec<TI>>>,
    /// `b[call][rank]`
    pub b: Vec<Vec<Vec<TI>>>,
    /// `bias[call]`
    pub bias: Vec<Option<Vec<TO>>>,
}

impl<TI: crate::Element, TO: crate::Element> CallInputs<TI, TO> {
    /// Inputs of calls with M = `ms[c]` on `world` ranks, each B [K, N] or [N, K] (the same
    /// values either way), a bias of N elements where `bias`.
    pub fn random(
        world: usize,
        (n, k): (usize, usize),
        bias: bool,
        ms: &[usize],
        seed: u64,
    ) -> Self {
        let calls = ms.len();
        CallInputs {
            a: super::random_per_rank(world, calls, (0, seed), |c, _| ms[c] * k),
            b: super::random_per_rank(world, calls, (1, seed), |_, _| k * n),
            bias: super::random_bias(world, calls, (n, bias), seed),
        }
    }
}

/// One output element of GEMM + reduce-scatter in float64, with the magnitudes its rounding
/// errors scale with: what [`element_bound`] needs to judge a computed element.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ReferenceElement {
    /// The exact result: Σ_r Σₖ a_r,ᵢₖ·b_r,ₖⱼ (+ biasⱼ).
    pub value: f64,
    /// Σ_r Σₖ |a_r,ᵢₖ·b_r,ₖⱼ|: the P accumulations' f32 rounding errors scale with it.
    pub abs_products: f64,
    /// Σ_r |Σₖ a_r,ᵢₖ·b_r,ₖⱼ|: the P partials' casts and the owner's f32 sum scale with it.
    pub abs_partials: f64,
    /// |biasⱼ| (0 without bias).
    pub abs_bias: f64,
}

/// Owner `owner`'s output chunk ([chunk rows, N], row-major) in float64 from every rank's
/// operands as stored: `a[r]` is rank r's A [M, K], `b[r]` its B in `shape.b_layout`, `bias`
/// [N] in the output type.
pub fn reference<TI: crate::Element, TO: crate::Element>(
    shape: &GemmRsShape,
    owner: usize,
    a: &[&[TI]],
    b: &[&[TI]],
    bias: Option<&[TO]>,
) -> Vec<ReferenceElement> {
    let (n, k) = (shape.n, shape.k);
    let rows = shape.chunk(owner);
    let mut out: Vec<ReferenceElement> = (0..rows.len() * n)
        .map(|x| {
            let bias_j = bias.map_or(0.0, |bias| bias[x % n].to_f64());
            ReferenceElement {
                value: bias_j,
                abs_products: 0.0,
                abs_partials: 0.0,
                abs_bias: bias_j.abs(),
            }
        })
        .collect();
    for (a, b) in a.iter().zip(b) {
        let a = &a[rows.start * k..rows.end * k];
        let (dots, abs) = crate::gemm::products_f64(rows.len(), n, k, a, b, shape.b_layout);
        for ((e, dot), abs) in out.iter_mut().zip(dots).zip(abs) {
            e.value += dot;
            e.abs_partials += dot.abs();
            e.abs_products += abs;
        }
    }
    out
}

/// The largest error a correct GEMM + reduce-scatter may make in one output element, the
/// bound of [`crate::gemm::element_bound`] carried through the reduction:
///
/// ```text
/// |out − ref| ≤ 2 · ( √K·u₃₂·Σ_rΣₖ|a b|                 P accumulations in f32
///                   + u_out·Σ_r|d_r|                     P partials cast to the output type
///                   + P·u₃₂·(1 + u_out)·(Σ_r|d_r| + |bias|)   the owner's f32 sum
///                   + u_out·|ref|                         the final cast
///                   + (P + 1) · half the output's smallest subnormal )
/// ```
///
/// with d_r = Σₖ a_r,ᵢₖ·b_r,ₖⱼ rank r's exact partial and u₃₂ = 2⁻²⁴, u_out = 2⁻⁸ (bf16), 2⁻¹¹
/// (f16), 2⁻²⁴ (f32) the unit roundoffs.
///
/// Derivation, following the computation: each rank's GEMM sums K exact products (a product of
/// two 16-bit values is exact in f32) in f32, which one GEMM's bound charges √K·u₃₂·Σₖ|ab|
/// (the probabilistic bound, see `element_bound`), P times over. Each rank then stores its
/// partial in the output type: one rounding of at most u_out·|d_r| each (at f32 output the
/// partial is the accumulator itself; the term, then u₃₂·|d_r|, is harmless). The owner adds
/// the P stored partials and the bias in f32: P additions (P − 1 between partials, one for the
/// bias), each rounding by at most u₃₂ of a partial sum no larger than the sum of the stored
/// magnitudes, Σ_r|d_r|·(1 + u_out) + |bias| (P·u₃₂ in all, the worst case: P is small). The
/// result is cast to the output type once more: u_out·|ref|. Each of the P + 1 casts may also
/// flush to the output type's subnormal grid, half its smallest step each. The factor 2 is
/// [`crate::gemm::BOUND_MARGIN`]: a correct reduction stays below half the bound.
///
/// What it catches: a partial missing, counted twice, taken from the other set or a previous
/// call (an error of the order of |d_r|, against a bound of the order of u_out·Σ_r|d_r|), a
/// shifted row or column, a bias missing or added twice (when |bias| exceeds the bound).
pub fn element_bound(shape: &GemmRsShape, want: &ReferenceElement) -> f64 {
    element_bound_on(shape, GemmRsPath::Fused, want)
}

/// [`element_bound`] for the results of `path`: the overlapped ring rounds its running sum to
/// the output type after each of P − 1 steps (each rounding at most u_out·Σ_r|d_r|), where the
/// fused path rounds each partial once.
pub fn element_bound_on(shape: &GemmRsShape, path: GemmRsPath, want: &ReferenceElement) -> f64 {
    let u_f32 = DType::F32.unit_roundoff();
    let u_out = shape.output.unit_roundoff();
    let p = shape.world as f64;
    let accumulation = (shape.k as f64).sqrt() * u_f32 * want.abs_products;
    let roundings = match path {
        GemmRsPath::Fused => 1.0,
        GemmRsPath::Overlapped { .. } => (p - 1.0).max(1.0),
        // the GEMM rounds each partial, then each of the P − 1 sums is rounded
        GemmRsPath::Unfused => p,
    };
    let partial_casts = roundings * u_out * want.abs_partials;
    let sum = p * u_f32 * ((1.0 + u_out) * want.abs_partials + want.abs_bias);
    let output = u_out * want.value.abs();
    let smallest_subnormal = match shape.output {
        DType::F32 => f64::powi(2.0, -149),
        DType::BF16 => f64::powi(2.0, -133),
        DType::F16 => f64::powi(2.0, -24),
    };
    BOUND_MARGIN
        * (accumulation + partial_casts + sum + output + (p + 1.0) * smallest_subnormal / 2.0)
}

/// Checks an owner's computed output chunk (in the reference's order) element by element
/// against [`element_bound`].
pub fn check_elements(
    shape: &GemmRsShape,
    got: impl IntoIterator<Item = f64>,
    want: &[ReferenceElement],
) -> ElementCheck {
    check_elements_on(shape, GemmRsPath::Fused, got, want)
}

/// [`check_elements`] against the bound of the path that computed the chunk.
pub fn check_elements_on(
    shape: &GemmRsShape,
    path: GemmRsPath,
    got: impl IntoIterator<Item = f64>,
    want: &[ReferenceElement],
) -> ElementCheck {
    let mut check = ElementCheck::default();
    let mut count = 0;
    for (index, (g, w)) in got.into_iter().zip(want).enumerate() {
        check.add_bounded(index, g, w.value, element_bound_on(shape, path, w));
        count += 1;
    }
    assert_eq!(
        count,
        want.len(),
        "one computed element per reference element"
    );
    check
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(world: usize, m: usize, n: usize) -> GemmRsShape {
        GemmRsShape::new(world, m, n, 64, BLayout::NK, DType::BF16, DType::BF16).unwrap()
    }

    #[test]
    fn a_named_path_takes_what_auto_would_for_what_it_leaves_open() {
        for (m, n) in [(64, 64), (8192, 8192), (16, 12)] {
            let s = shape(2, m, n);
            assert_eq!(parse_path("auto", None, &s), Ok(None));
            assert_eq!(
                parse_path("overlapped", None, &s),
                Ok(Some(match choose_overlapping_path(&s) {
                    GemmRsPath::Overlapped { pieces } => GemmRsPath::Overlapped { pieces },
                    _ => GemmRsPath::Overlapped { pieces: 1 },
                }))
            );
            assert_eq!(
                parse_path("overlapped", Some(4), &s),
                Ok(Some(GemmRsPath::Overlapped { pieces: 4 }))
            );
            assert_eq!(parse_path("fused", None, &s), Ok(Some(GemmRsPath::Fused)));
            assert_eq!(
                parse_path("unfused", None, &s),
                Ok(Some(GemmRsPath::Unfused))
            );
            assert_eq!(
                parse_path("fused", Some(2), &s),
                Err(PathNameError::PiecesWithoutOverlapped)
            );
            assert_eq!(
                parse_path("fast", None, &s),
                Err(PathNameError::Unknown("fast".into()))
            );
        }
        // two pieces where auto takes two
        assert_eq!(
            parse_path("overlapped", None, &shape(2, 8192, 8192)),
            Ok(Some(GemmRsPath::Overlapped { pieces: 2 }))
        );
    }

    const TILE: TileShape = KERNEL_TILE;

    #[test]
    fn no_tile_straddles_two_owners_and_every_element_is_covered_once() {
        for world in 1..=9 {
            for m in [1, 7, 128, 129, 1000, 1031, 4096] {
                let s = shape(world, m, 300);
                let sched = GemmRsSchedule::new(s, TILE);
                let mut covered = vec![0u8; m * 300];
                for t in 0..sched.tile_count() {
                    let (owner, _) = sched.placement[t];
                    let (rows, cols) = sched.tile_bounds(t);
                    assert!(rows.len() <= 128 && !rows.is_empty());
                    let chunk = s.chunk(owner);
                    assert!(
                        chunk.start <= rows.start && rows.end <= chunk.end,
                        "P={world} M={m} t={t}"
                    );
                    for i in rows.clone() {
                        for j in cols.clone() {
                            covered[i * 300 + j] += 1;
                        }
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "P={world} M={m}");
                let plan = sched.gemm_plan(world - 1, 2);
                plan.validate(world).unwrap();
            }
        }
    }

    #[test]
    fn every_rank_starts_with_a_different_peer_and_ends_with_its_own_tiles() {
        let s = shape(4, 4 * 512, 1024);
        let sched = GemmRsSchedule::new(s, TILE);
        let firsts: Vec<usize> = (0..4)
            .map(|r| sched.placement[sched.order(r)[0]].0)
            .collect();
        assert_eq!(firsts, vec![1, 2, 3, 0]);
        for r in 0..4 {
            let order = sched.order(r);
            let last = *order.last().unwrap();
            assert_eq!(sched.placement[last].0, r);
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, (0..sched.tile_count()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn destinations_and_flags_of_different_senders_or_sets_never_meet() {
        let s = shape(3, 1000, 700);
        let sched = GemmRsSchedule::new(s, TILE);
        let mut seen_flags = std::collections::HashSet::new();
        let mut written: Vec<Vec<u8>> = vec![vec![0; 2 * 3 * sched.slot_len]; 3];
        for set in 0..2 {
            for sender in 0..3 {
                for t in 0..sched.tile_count() {
                    let d = sched.destination(sender, t, set);
                    let f = sched.flag(sender, t, set as u64 + 1);
                    assert!(seen_flags.insert((d.rank, f.slot)), "flag used twice");
                    let (rows, cols) = sched.tile_bounds(t);
                    for i in 0..rows.len() {
                        for j in 0..cols.len() {
                            written[d.rank][d.offset + i * d.ld + j] += 1;
                        }
                    }
                }
            }
        }
        assert!(written.iter().flatten().all(|&w| w <= 1));
    }

    /// The plan checker proves of the fused schedule what it proves of the collectives, for
    /// P = 1..9, several bands per chunk and ragged N; and it rejects the schedule with a flag
    /// missing (deadlock) or a partial read before its flag (race).
    #[test]
    fn the_checker_accepts_the_schedule_and_rejects_it_broken() {
        let small = TileShape { m: 16, n: 32 };
        for world in 1..=9 {
            for (m, n) in [(world * 16, 40), (world * 37, 70), (world, 32)] {
                let s = GemmRsSchedule::new(shape(world, m, n), small);
                let plan = s.plan().unwrap();
                if let Err(e) = crate::check(plan) {
                    panic!("P={world} M={m} N={n}: {e}");
                }
            }
        }
        let s = GemmRsSchedule::new(shape(3, 96, 40), small);
        // a sender that never raises one flag: the owner waits forever
        let mut plan = s.plan().unwrap();
        let at = plan.steps[1]
            .iter()
            .position(|st| matches!(st, crate::plan::Step::Notify { .. }))
            .unwrap();
        plan.steps[1].remove(at);
        assert!(crate::check(plan).is_err());
        // an owner that reads its peers' partials before waiting for them
        let mut plan = s.plan().unwrap();
        plan.steps[0].retain(|st| !matches!(st, crate::plan::Step::Wait { .. }));
        assert!(crate::check(plan).is_err());
        // M not a multiple of P: refused with a reason, not checked wrongly
        let e = GemmRsSchedule::new(shape(3, 97, 40), small)
            .plan()
            .unwrap_err();
        assert!(e.to_string().contains("multiple of P"), "{e}");
    }

    #[test]
    fn a_smaller_m_fits_the_buffers_and_flag_rows_of_the_largest() {
        for world in 1..=9 {
            let max = GemmRsSchedule::new(shape(world, 3000, 600), TILE);
            for m in [1, world, 129, 1000, 2999, 3000] {
                let s = GemmRsSchedule::within(shape(world, m, 600), 3000, TILE);
                assert_eq!((s.slot_len, s.flag_stride), (max.slot_len, max.flag_stride));
                for t in 0..s.tile_count() {
                    for sender in 0..world {
                        let d = s.destination(sender, t, 1);
                        let (rows, cols) = s.tile_bounds(t);
                        let end = d.offset + (rows.len() - 1) * d.ld + cols.len();
                        assert!(end <= 2 * world * s.slot_len, "P={world} M={m}");
                        assert!((s.flag(sender, t, 2).slot.col as usize) < s.flag_columns());
                    }
                }
            }
        }
    }

    #[test]
    fn a_configuration_takes_its_chosen_path_or_the_cost_models_for_each_shape() {
        let c = GemmRsConfig::new(8192, 8192, 3584, BLayout::NK, DType::BF16, DType::BF16);
        assert_eq!(
            (c.tile, c.path, c.bias),
            (KERNEL_TILE, PathChoice::Auto, false)
        );
        // auto follows the shape: the unfused path for a short reduce-scatter, the ring above
        assert_eq!(c.path_for(&c.shape(2, 16).unwrap()), GemmRsPath::Unfused);
        assert_eq!(
            c.path_for(&c.shape(2, 8192).unwrap()),
            GemmRsPath::Overlapped { pieces: 2 }
        );
        let fused = GemmRsConfig {
            path: PathChoice::Always(GemmRsPath::Fused),
            ..c
        };
        assert_eq!(fused.path_for(&c.shape(2, 16).unwrap()), GemmRsPath::Fused);
        // the shape is validated as GemmRsShape's constructor validates it
        let odd_k = GemmRsConfig { k: 12, ..c };
        assert!(odd_k.shape(2, 16).is_err());
        assert!(c.shape(0, 16).is_err());
    }
}

#[cfg(test)]
mod bound_tests {
    use super::*;
    use crate::Element;
    use half::{bf16, f16};

    /// Uniform in [-1, 1), as the benches' inputs.
    fn uniform<T: Element>(seed: u64, stream: usize, len: usize) -> Vec<T> {
        (0..len)
            .map(|i| {
                T::from_f32(crate::reference::input_value(
                    seed,
                    stream,
                    i,
                    crate::ReduceOp::Sum,
                ))
            })
            .collect()
    }

    /// What a correct operator computes for owner `owner`: each rank's partial summed in f32
    /// and cast to the output type, the owner's sum of the stored partials in f32 in rank
    /// order, the bias, one cast.
    fn computed<TI: Element, TO: Element>(
        s: &GemmRsShape,
        owner: usize,
        a: &[Vec<TI>],
        b: &[Vec<TI>],
        bias: &[TO],
    ) -> Vec<f64> {
        let (n, k) = (s.n, s.k);
        let mut out = Vec::new();
        for i in s.chunk(owner) {
            for j in 0..n {
                let mut acc = 0f32;
                for (a, b) in a.iter().zip(b) {
                    let mut partial = 0f32;
                    for kk in 0..k {
                        let bv = match s.b_layout {
                            BLayout::KN => b[kk * n + j],
                            BLayout::NK => b[j * k + kk],
                        };
                        partial += a[i * k + kk].to_f32() * bv.to_f32();
                    }
                    acc += TO::from_f32(partial).to_f32();
                }
                out.push(TO::from_f32(acc + bias[j].to_f32()).to_f64());
            }
        }
        out
    }

    struct Case<TI, TO> {
        shape: GemmRsShape,
        a: Vec<Vec<TI>>,
        b: Vec<Vec<TI>>,
        bias: Vec<TO>,
    }

    fn case<TI: Element, TO: Element>(p: usize, m: usize, n: usize, k: usize) -> Case<TI, TO> {
        let shape = GemmRsShape::new(p, m, n, k, BLayout::NK, TI::DTYPE, TO::DTYPE).unwrap();
        Case {
            shape,
            a: (0..p).map(|r| uniform(7, 2 * r, m * k)).collect(),
            b: (0..p).map(|r| uniform(7, 2 * r + 1, n * k)).collect(),
            bias: uniform(7, 2 * p, n),
        }
    }

    impl<TI: Element, TO: Element> Case<TI, TO> {
        fn want(&self, owner: usize) -> Vec<ReferenceElement> {
            let a: Vec<&[TI]> = self.a.iter().map(Vec::as_slice).collect();
            let b: Vec<&[TI]> = self.b.iter().map(Vec::as_slice).collect();
            reference(&self.shape, owner, &a, &b, Some(&self.bias))
        }
        fn got(&self, owner: usize) -> Vec<f64> {
            computed(&self.shape, owner, &self.a, &self.b, &self.bias)
        }
    }

    fn correct_results_pass<TI: Element, TO: Element>() {
        for (p, k) in [(1, 8), (3, 136), (8, 1032)] {
            let c = case::<TI, TO>(p, 2 * p + 1, 9, k);
            for owner in 0..p {
                let check = check_elements(&c.shape, c.got(owner), &c.want(owner));
                assert!(
                    check.passed() && check.worst_ratio < 1.0 / BOUND_MARGIN,
                    "P={p} K={k} {}→{} owner {owner}: {check}",
                    TI::DTYPE,
                    TO::DTYPE
                );
            }
        }
    }

    #[test]
    fn correct_results_stay_within_half_the_bound() {
        correct_results_pass::<bf16, bf16>();
        correct_results_pass::<bf16, f32>();
        correct_results_pass::<f16, f16>();
        correct_results_pass::<f16, f32>();
    }

    #[test]
    fn a_single_wrong_element_fails() {
        let c = case::<bf16, bf16>(3, 7, 16, 64);
        let (owner, want) = (1, c.want(1));
        let correct = c.got(owner);
        assert!(check_elements(&c.shape, correct.clone(), &want).passed());
        // each element in turn with one rank's partial missing (the smallest, the hardest to
        // see) is caught on its own, and it is the worst
        let mut caught = 0;
        for idx in 0..want.len() {
            let (i, j) = (c.shape.chunk(owner).start + idx / 16, idx % 16);
            let smallest = (0..3)
                .map(|r| {
                    (0..64)
                        .map(|kk| c.a[r][i * 64 + kk].to_f64() * c.b[r][j * 64 + kk].to_f64())
                        .sum::<f64>()
                })
                .min_by(|x, y| x.abs().total_cmp(&y.abs()))
                .unwrap();
            let mut got = correct.clone();
            got[idx] -= smallest;
            let check = check_elements(&c.shape, got.clone(), &want);
            if smallest.abs() > 2.0 * element_bound(&c.shape, &want[idx]) {
                assert_eq!(check.out_of_bound, 1, "element {idx}: {check}");
                assert_eq!(check.worst.unwrap().0, idx);
                caught += 1;
            }
            // any perturbation past the bound fails
            got[idx] = want[idx].value - 1.01 * element_bound(&c.shape, &want[idx]);
            assert_eq!(check_elements(&c.shape, got, &want).out_of_bound, 1);
        }
        // (the smallest partial of three is rarely below the bound)
        assert!(caught * 10 >= want.len() * 9, "{caught} of {}", want.len());
        // the bias missing: every element whose bias exceeds the bound
        let mut got = correct.clone();
        let mut expect_fail = 0;
        for (idx, g) in got.iter_mut().enumerate() {
            let bias = c.bias[idx % 16].to_f64();
            *g -= bias;
            expect_fail += (bias.abs() > 2.0 * element_bound(&c.shape, &want[idx])) as usize;
        }
        let check = check_elements(&c.shape, got, &want);
        assert!(
            expect_fail > want.len() / 2 && check.out_of_bound >= expect_fail,
            "{check}"
        );
        // an unwritten (poisoned) element
        let mut got = correct;
        got[3] = f64::NAN;
        let check = check_elements(&c.shape, got, &want);
        assert_eq!((check.out_of_bound, check.worst_ratio), (1, f64::INFINITY));
    }
}
