//! All-gather + GEMM, the column-parallel linear layer of tensor parallelism with sequence
//! parallelism (the semantics of Flux's AGKernel and PyTorch's `fused_all_gather_matmul`): rank
//! r holds chunk r of the rows of A ([M_r, K], chunks split as the collectives split M) and its
//! own B_r ([K, N] or [N, K]) with an optional bias [N]; every rank's output is
//! AllGather(A)·B_r (+ bias), [M, N], and optionally the gathered A itself.
//!
//! The overlapped schedule, for every rank r:
//! * At the start of a call r hands its chunk, cut into `pieces` row pieces, to every peer (r − 1
//!   first, [`AgGemmSchedule::receivers_of`], so that each rank's first peer chunk lands first): a
//!   copy into the peer's gather buffer at the chunk's rows, then that piece's flag on the peer
//!   set to the call's number (copies by the copy engine on GPUs, beside the GEMMs). Before its
//!   first copy into a peer it waits until that peer's "done" of the previous call has come:
//!   the peer has finished reading its gather buffer.
//! * Its GEMMs take the chunks in the order r, r + 1, …, r + P − 1 (its own first, from the
//!   caller's A, then the peers' in the order their copies were started), one GEMM per piece,
//!   each waiting for its piece's flag, writing the output rows of that piece.
//! * At the end of a call every rank raises its "done" flag on every peer, and does not wait:
//!   the peers wait for it only before they next write into its gather buffer, which on GPUs is
//!   the side stream's business, so no cross-GPU round trip ends a call. One set of buffers and
//!   flags serves every call; flags hold call numbers (from 1) and are never cleared. A rank
//!   that is dropped first waits (bounded) for its peers' last dones, the last writes into its
//!   memory.
//!
//! Cost card (per rank, per call): (P − 1)·M_r·K input elements sent and (M − M_r)·K received;
//! P·pieces GEMMs; P − 1 + (P − 1)·pieces flags raised.
//!
//! The fused schedule ([`AgGemmSchedule::fused_plan`]) moves the same pieces with the same flags
//! but computes one GEMM of all M rows per call: its row bands start at every piece's start (no
//! band mixes two pieces), its tiles come piece by piece in the overlapped schedule's order (the
//! rank's own chunk first, read from the caller's A, then the peers' pieces as they arrive),
//! and before loading a band's rows of A it waits for its piece's flag
//! ([`AgGemmSchedule::band_waits`]), so no tile waits for more than its own rows.

use crate::dtype::DType;
use crate::error::Error;
use crate::gemm::{
    grouped_order_of_grid, BLayout, Epilogue, GemmPlan, GemmProblem, TileShape, KERNEL_TILE,
};
use crate::op::chunk_range;
use std::ops::Range;
use std::time::Duration;

/// The most pieces a chunk is cut into.
pub const MAX_PIECES: usize = 16;

/// What an all-gather + GEMM operator is built for, on either backend: every call has this N,
/// K, layout and types and up to `max_m` gathered rows. The group it runs on gives the world
/// size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgGemmConfig {
    /// The most rows of the gathered A (every rank holds its chunk of them)
    pub max_m: usize,
    pub n: usize,
    pub k: usize,
    pub b_layout: BLayout,
    /// bf16 or f16
    pub input: DType,
    /// The input type or f32
    pub output: DType,
    /// Whether calls add a bias [N] (output type)
    pub bias: bool,
    /// Row pieces each chunk is handed on in (1 to [`MAX_PIECES`])
    pub pieces: usize,
    /// The fused path: one GEMM whose loads wait for each row band's piece
    /// ([`AgGemmSchedule::fused_plan`]), instead of one library GEMM per piece
    pub fused: bool,
    /// Output tile of the fused path's GEMM: [`KERNEL_TILE`] (the simulator also takes others;
    /// the CUDA backend refuses them on the fused path)
    pub tile: TileShape,
    /// How long any wait of a call may last before the call fails with a diagnosis: the CUDA
    /// operator's waits on the device and the host; on the simulator, the waits of the world
    /// it runs in, which its callers configure with this value
    pub timeout: Duration,
}

/// The path and pieces that a path's name ("auto", "overlapped", "fused") and an optional number
/// of pieces ask for, the one vocabulary of the command line and the Python package: whether
/// the path is the fused one, and the pieces (1 to [`MAX_PIECES`]).
///
/// "auto", and pieces left out, take the overlapped path in whole chunks: on 2 × H200 it was the
/// faster at all six tensor-parallel shapes measured (docs/performance.md, "All-gather + GEMM":
/// the fused path hides the gather within 2 % of our GEMM alone, but our GEMM trails cuBLASLt,
/// which the overlapped path runs), and one piece was the faster of one and two there.
pub fn parse_path(name: &str, pieces: Option<usize>) -> Result<(bool, usize), AgPathError> {
    let fused = match name {
        "auto" | "overlapped" => false,
        "fused" => true,
        other => return Err(AgPathError::Unknown(other.to_string())),
    };
    match pieces {
        None => Ok((fused, 1)),
        Some(p) if (1..=MAX_PIECES).contains(&p) => Ok((fused, p)),
        Some(p) => Err(AgPathError::Pieces(p)),
    }
}

/// Why a path's name and pieces name no path of the all-gather + GEMM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgPathError {
    /// Not one of auto, overlapped, fused
    Unknown(String),
    /// Pieces outside 1 to [`MAX_PIECES`]
    Pieces(usize),
}

impl std::fmt::Display for AgPathError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgPathError::Unknown(name) => {
                write!(f, "unknown path {name:?}: auto, overlapped or fused")
            }
            AgPathError::Pieces(p) => write!(f, "pieces must be 1 to {MAX_PIECES}, got {p}"),
        }
    }
}

impl std::error::Error for AgPathError {}

impl AgGemmConfig {
    /// The defaults: no bias, whole chunks (one piece), the overlapped path, the kernel's
    /// tile, 5 s waits.
    pub fn new(
        max_m: usize,
        n: usize,
        k: usize,
        b_layout: BLayout,
        input: DType,
        output: DType,
    ) -> AgGemmConfig {
        AgGemmConfig {
            max_m,
            n,
            k,
            b_layout,
            input,
            output,
            bias: false,
            pieces: 1,
            fused: false,
            tile: KERNEL_TILE,
            timeout: Duration::from_secs(5),
        }
    }

    /// The shape of a call of `m` gathered rows on `world` ranks (validated).
    pub fn shape(&self, world: usize, m: usize) -> Result<AgGemmShape, Error> {
        AgGemmShape::new(
            world,
            m,
            self.n,
            self.k,
            self.b_layout,
            self.input,
            self.output,
        )
    }
}

/// What one all-gather + GEMM call computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct AgGemmShape {
    pub world: usize,
    /// Rows of the gathered A (and of every rank's output), split over the ranks
    pub m: usize,
    /// Columns of every rank's B_r and output
    pub n: usize,
    pub k: usize,
    pub b_layout: BLayout,
    /// bf16 or f16
    pub input: DType,
    /// The input type or f32
    pub output: DType,
}

impl AgGemmShape {
    pub fn new(
        world: usize,
        m: usize,
        n: usize,
        k: usize,
        b_layout: BLayout,
        input: DType,
        output: DType,
    ) -> Result<AgGemmShape, Error> {
        super::check_shape(
            "all-gather + GEMM",
            world,
            (m, n, k),
            b_layout,
            input,
            output,
        )?;
        Ok(AgGemmShape {
            world,
            m,
            n,
            k,
            b_layout,
            input,
            output,
        })
    }

    /// Rows of A held by rank `owner`.
    pub fn chunk(&self, owner: usize) -> Range<usize> {
        chunk_range(self.m, self.world, owner)
    }

    /// Every rank's whole product: the gathered A [M, K] times its B.
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
}

/// One GEMM of a rank: rows `rows` of the gathered A (absolute), from chunk `owner`'s piece
/// `piece`; the rank's own chunk (`local`) is read from the caller's A and waits for nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgPiece {
    pub owner: usize,
    pub piece: usize,
    pub rows: Range<usize>,
    pub local: bool,
}

/// The overlapped schedule of one shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgGemmSchedule {
    pub shape: AgGemmShape,
    /// Row pieces per chunk
    pub pieces: usize,
}

impl AgGemmSchedule {
    pub fn new(shape: AgGemmShape, pieces: usize) -> AgGemmSchedule {
        AgGemmSchedule {
            shape,
            pieces: pieces.clamp(1, MAX_PIECES),
        }
    }

    /// Rows (absolute) of piece `piece` of `owner`'s chunk; the same cut on every rank.
    pub fn piece_rows(&self, owner: usize, piece: usize) -> Range<usize> {
        let chunk = self.shape.chunk(owner);
        let within = chunk_range(chunk.len(), self.pieces, piece);
        chunk.start + within.start..chunk.start + within.end
    }

    /// The pieces rank `rank` hands to its peers (its own chunk's, in order; empty ones left
    /// out on every rank alike).
    pub fn sent_by(&self, rank: usize) -> Vec<AgPiece> {
        (0..self.pieces)
            .map(|piece| AgPiece {
                owner: rank,
                piece,
                rows: self.piece_rows(rank, piece),
                local: false,
            })
            .filter(|g| !g.rows.is_empty())
            .collect()
    }

    /// The peers rank `rank` hands its pieces to, in order: r − 1, r − 2, …, so that every
    /// receiver gets the chunks in the order it computes them ([`AgGemmSchedule::gemms_of`]:
    /// r + 1 first, whose first copy goes to r).
    pub fn receivers_of(&self, rank: usize) -> impl Iterator<Item = usize> {
        let p = self.shape.world;
        (1..p).map(move |d| (rank + p - d) % p)
    }

    /// Rank `rank`'s GEMMs in order: its own chunk, then r + 1, r + 2, ….
    pub fn gemms_of(&self, rank: usize) -> Vec<AgPiece> {
        let p = self.shape.world;
        (0..p)
            .map(|d| (rank + d) % p)
            .flat_map(|owner| (0..self.pieces).map(move |piece| (owner, piece)))
            .map(|(owner, piece)| AgPiece {
                owner,
                piece,
                rows: self.piece_rows(owner, piece),
                local: owner == rank,
            })
            .filter(|g| !g.rows.is_empty())
            .collect()
    }

    /// The flag (on the receiving rank) that piece `piece` of `owner`'s chunk has arrived.
    pub fn flag_index(&self, owner: usize, piece: usize) -> usize {
        owner * MAX_PIECES + piece
    }

    /// The flag `sender` raises on a rank when it has finished a call.
    pub fn done_index(&self, sender: usize) -> usize {
        self.shape.world * MAX_PIECES + sender
    }

    /// Flag words a rank needs.
    pub fn flag_words(&self) -> usize {
        self.shape.world * (MAX_PIECES + 1)
    }

    /// The fused path's bands in row order: each non-empty piece cut into bands of at most
    /// `tile_m` rows from its first row, as (first row, owner, piece).
    fn bands_by_piece(&self, tile_m: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        (0..self.shape.world)
            .flat_map(move |owner| (0..self.pieces).map(move |piece| (owner, piece)))
            .flat_map(move |(owner, piece)| {
                self.piece_rows(owner, piece)
                    .step_by(tile_m.max(1))
                    .map(move |row| (row, owner, piece))
            })
    }

    /// The fused path's row bands (starts, then M): each non-empty piece cut into bands of at
    /// most `tile_m` rows from its first row.
    pub fn fused_bands(&self, tile_m: usize) -> Vec<usize> {
        self.bands_by_piece(tile_m)
            .map(|(row, _, _)| row)
            .chain([self.shape.m])
            .collect()
    }

    /// The fused path's GEMM on rank `rank`: all M rows of the gathered A times its B (+ the
    /// bias with `bias`), in [`AgGemmSchedule::fused_bands`], tiles piece by piece in the order
    /// of [`AgGemmSchedule::gemms_of`], each piece's tiles in the grouped order (L2 reuse), into
    /// the local output.
    pub fn fused_plan(&self, rank: usize, tile: TileShape, bias: bool, group: usize) -> GemmPlan {
        let bands = self.fused_bands(tile.m);
        let epilogue = Epilogue {
            bias,
            ..Epilogue::default()
        };
        let mut plan = GemmPlan::local(self.shape.problem(), tile, epilogue);
        let tn = plan.tile_grid().1;
        let band_of = |row: usize| bands.partition_point(|&b| b <= row) - 1;
        plan.order = self
            .gemms_of(rank)
            .iter()
            .flat_map(|g| {
                let (b0, b1) = (band_of(g.rows.start), band_of(g.rows.end - 1) + 1);
                grouped_order_of_grid(b1 - b0, tn, group)
                    .into_iter()
                    .map(move |t| b0 * tn + t)
            })
            .collect();
        plan.bands = Some(bands);
        plan
    }

    /// Per band of [`AgGemmSchedule::fused_bands`]: the piece (owner, piece) whose flag rank
    /// `rank` waits for before loading the band's rows, or `None` for its own rows.
    pub fn band_waits(&self, rank: usize, tile_m: usize) -> Vec<Option<(usize, usize)>> {
        self.bands_by_piece(tile_m)
            .map(|(_, owner, piece)| (owner != rank).then_some((owner, piece)))
            .collect()
    }

    /// The schedule as a plan for the checker: an all-gather of the rows of A (rank r's input
    /// is its chunk, every rank's output the gathered A) in which each piece is copied into
    /// every peer's gather buffer (scratch) and flagged, and each GEMM's read of its rows is
    /// the copy of those rows into the gathered A the call returns — from the rank's own input
    /// for its chunk, from the gather buffer after the piece's flag for a peer's; at the end
    /// every rank raises its done on every peer and waits for all of theirs — the wait that
    /// the side stream makes between this call's copies and the next call's, so that the plan's
    /// one sequence of steps per rank orders every write into a peer after that peer's reads.
    /// The checker proves no deadlock, no flag used twice, no row read before it landed, none
    /// overwritten while read (its two consecutive runs are two calls), and every output the
    /// gathered A. Its all-gather splits M·K evenly: M must be a multiple of P.
    pub fn plan(&self) -> Result<crate::plan::Plan, Error> {
        use crate::op::{OpKind, OpSpec};
        use crate::plan::{BufferKind, PlanBuilder, Region, Slot};
        let (p, k) = (self.shape.world, self.shape.k);
        if !self.shape.m.is_multiple_of(p) {
            return Err(Error::Unsupported(format!(
                "the checker sees all-gather + GEMM as an all-gather of M·K elements split evenly: M = {} must be a multiple of P = {p}",
                self.shape.m
            )));
        }
        let spec = OpSpec::new(OpKind::AllGather, p, self.shape.m * k, 0)?;
        let mut b = PlanBuilder::new(spec);
        let arrival = b.rows(1);
        let done = b.rows(1);
        // every rank's gather buffer, [M, K]
        let gather = b.scratch(self.shape.m * k);
        let rows = |r: &Range<usize>| r.start * k..r.end * k;
        let gathered = |r: &Range<usize>| gather + r.start * k..gather + r.end * k;
        for rank in 0..p {
            let start = self.shape.chunk(rank).start;
            for g in self.sent_by(rank) {
                let within = g.rows.start - start..g.rows.end - start;
                let src = Region::new(rank, BufferKind::Input, rows(&within));
                let dsts = (0..p)
                    .filter(|&q| q != rank)
                    .map(|q| Region::new(q, BufferKind::Scratch, gathered(&g.rows)))
                    .collect::<Vec<_>>();
                if !dsts.is_empty() {
                    b.copy_to(rank, src, dsts);
                }
                let col = (rank * self.pieces + g.piece) as u32;
                for q in (0..p).filter(|&q| q != rank) {
                    b.signal(rank, q, Slot::new(arrival, col));
                }
            }
            // a GEMM reads its rows: its own from its input, a peer's from the gather buffer
            // after the piece's flag (modelled as the copy into the gathered A it returns)
            for g in self.gemms_of(rank) {
                let dst = Region::new(rank, BufferKind::Output, rows(&g.rows));
                if g.local {
                    let within = g.rows.start - start..g.rows.end - start;
                    b.copy(
                        rank,
                        Region::new(rank, BufferKind::Input, rows(&within)),
                        dst,
                    );
                } else {
                    let col = (g.owner * self.pieces + g.piece) as u32;
                    b.wait(rank, Slot::new(arrival, col), 1);
                    b.copy(
                        rank,
                        Region::new(rank, BufferKind::Scratch, gathered(&g.rows)),
                        dst,
                    );
                }
            }
            for q in (0..p).filter(|&q| q != rank) {
                b.signal(rank, q, Slot::new(done, rank as u32));
            }
            // the waits for the peers' dones, which on GPUs the side stream makes after its
            // copies of this call and before those of the next (the caller's stream goes on)
            for q in (0..p).filter(|&q| q != rank) {
                b.wait(rank, Slot::new(done, q as u32), 1);
            }
        }
        Ok(b.finish("ag-gemm"))
    }
}

/// Random operands of a run of calls, uniform in [-1, 1) from `seed` by the project's indexable
/// stream ([`crate::reference::input_value`]), so that one seed gives the same operands on
/// every backend.
pub struct AgCallInputs<TI, TO> {
    /// `a[call][rank]`: the rank's chunk of the gathered A
    pub a: Vec<Vec<Vec<TI>>>,
    /// `b[call][rank]`
    pub b: Vec<Vec<Vec<TI>>>,
    /// `bias[call]` (each rank's B has its own columns, the bias is replicated like a parameter)
    pub bias: Vec<Option<Vec<TO>>>,
}

impl<TI: crate::Element, TO: crate::Element> AgCallInputs<TI, TO> {
    /// Inputs of calls with M = `ms[c]` gathered rows on `world` ranks (chunks split as the
    /// collectives split M), each B of K × N elements, a bias of N where `bias`.
    pub fn random(
        world: usize,
        (n, k): (usize, usize),
        bias: bool,
        ms: &[usize],
        seed: u64,
    ) -> Self {
        let calls = ms.len();
        let chunk = |c: usize, r: usize| crate::op::chunk_range(ms[c], world, r).len();
        AgCallInputs {
            a: super::random_per_rank(world, calls, (0, seed), |c, r| chunk(c, r) * k),
            b: super::random_per_rank(world, calls, (1, seed), |_, _| k * n),
            bias: super::random_bias(world, calls, (n, bias), seed),
        }
    }

    /// Call `call`'s gathered A (every rank's chunk in rank order).
    pub fn gathered(&self, call: usize) -> Vec<TI> {
        self.a[call].iter().flatten().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_name_and_pieces_say_the_path_auto_the_overlapped_one_in_whole_chunks() {
        assert_eq!(parse_path("auto", None), Ok((false, 1)));
        assert_eq!(parse_path("overlapped", None), Ok((false, 1)));
        assert_eq!(parse_path("fused", None), Ok((true, 1)));
        assert_eq!(parse_path("auto", Some(4)), Ok((false, 4)));
        assert_eq!(
            parse_path("fused", Some(MAX_PIECES)),
            Ok((true, MAX_PIECES))
        );
        assert_eq!(parse_path("fused", Some(0)), Err(AgPathError::Pieces(0)));
        assert_eq!(
            parse_path("overlapped", Some(MAX_PIECES + 1)),
            Err(AgPathError::Pieces(MAX_PIECES + 1))
        );
        let e = parse_path("unfused", None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown path \"unfused\": auto, overlapped or fused"
        );
    }

    fn schedule(world: usize, m: usize, pieces: usize) -> AgGemmSchedule {
        let shape =
            AgGemmShape::new(world, m, 24, 16, BLayout::NK, DType::BF16, DType::BF16).unwrap();
        AgGemmSchedule::new(shape, pieces)
    }

    /// The fused GEMM: a valid plan of every tile once; no band mixes two pieces; each band
    /// waits for exactly the piece its rows belong to (none for the rank's own rows); tiles come
    /// piece by piece in the overlapped schedule's order. Tile rows 4 and 128, ragged M, M < P.
    #[test]
    fn the_fused_gemm_takes_pieces_in_order_and_waits_for_each_band_s_own_piece() {
        for world in 1..=9 {
            for m in [1, world, 3 * world + 1, 64, 300] {
                for pieces in [1, 2, 3] {
                    for tile_m in [4, 128] {
                        let s = schedule(world, m, pieces);
                        let tile = TileShape { m: tile_m, n: 8 };
                        for rank in 0..world {
                            let plan = s.fused_plan(rank, tile, true, 8);
                            plan.validate(world).unwrap();
                            let bands = plan.bands.clone().unwrap();
                            let waits = s.band_waits(rank, tile_m);
                            assert_eq!(waits.len(), bands.len() - 1);
                            // (owner, piece) of every band, from its rows
                            let piece_of = |row: usize| {
                                (0..world)
                                    .flat_map(|o| (0..pieces).map(move |j| (o, j)))
                                    .find(|&(o, j)| s.piece_rows(o, j).contains(&row))
                                    .unwrap()
                            };
                            for (i, w) in bands.windows(2).enumerate() {
                                let (o, j) = piece_of(w[0]);
                                assert_eq!(piece_of(w[1] - 1), (o, j), "band {i} mixes pieces");
                                assert_eq!(waits[i], (o != rank).then_some((o, j)));
                            }
                            // the pieces in the order the tiles first touch them
                            let tn = plan.tile_grid().1;
                            let mut seen: Vec<(usize, usize)> = Vec::new();
                            for &t in &plan.order {
                                let piece = piece_of(bands[t / tn]);
                                if seen.last() != Some(&piece) {
                                    assert!(!seen.contains(&piece), "piece {piece:?} split");
                                    seen.push(piece);
                                }
                            }
                            let want: Vec<(usize, usize)> = s
                                .gemms_of(rank)
                                .iter()
                                .map(|g| (g.owner, g.piece))
                                .collect();
                            assert_eq!(seen, want, "P={world} M={m} rank {rank}");
                        }
                    }
                }
            }
        }
    }

    /// The d-th chunk a rank computes after its own is the one whose owner sends to it d-th:
    /// at P ≥ 3 every rank's first peer chunk is the first to land.
    #[test]
    fn receivers_get_the_chunks_in_the_order_they_compute_them() {
        for world in 1..=9 {
            let s = schedule(world, 4 * world, 1);
            for rank in 0..world {
                let owners: Vec<usize> = s
                    .gemms_of(rank)
                    .iter()
                    .filter(|g| !g.local)
                    .map(|g| g.owner)
                    .collect();
                for (d, &owner) in owners.iter().enumerate() {
                    let sends: Vec<usize> = s.receivers_of(owner).collect();
                    assert_eq!(sends.len(), world - 1);
                    assert_eq!(sends[d], rank, "P={world}: owner {owner}'s send {d}");
                }
            }
        }
    }

    #[test]
    fn every_rank_computes_every_row_once_its_own_first() {
        for world in 1..=9 {
            for m in [1, world, 3 * world + 1, 64] {
                for pieces in [1, 2, 3, 5] {
                    let s = schedule(world, m, pieces);
                    for rank in 0..world {
                        let gemms = s.gemms_of(rank);
                        let mut rows: Vec<usize> =
                            gemms.iter().flat_map(|g| g.rows.clone()).collect();
                        rows.sort();
                        assert_eq!(rows, (0..m).collect::<Vec<_>>(), "P={world} M={m}");
                        // its own chunk first, and only its own is local
                        let own = gemms.iter().take_while(|g| g.owner == rank).count();
                        assert_eq!(own, gemms.iter().filter(|g| g.local).count());
                        assert!(gemms.iter().all(|g| g.local == (g.owner == rank)));
                        // every remote piece it waits for is one its owner sends
                        for g in gemms.iter().filter(|g| !g.local) {
                            assert!(s.sent_by(g.owner).iter().any(|x| x.rows == g.rows));
                        }
                    }
                }
            }
        }
    }

    /// The checker proves of the schedule what it proves of the collectives, P = 1..9 and 16,
    /// 1–3 pieces, and rejects it with a flag missing or a read before its flag.
    #[test]
    fn the_checker_accepts_the_schedule_and_rejects_it_broken() {
        for world in (1..=9).chain([16]) {
            for m in [world, world * 5] {
                for pieces in 1..=3 {
                    let plan = schedule(world, m, pieces).plan().unwrap();
                    if let Err(e) = crate::check(plan) {
                        panic!("P={world} M={m} pieces={pieces}: {e}");
                    }
                }
            }
        }
        let s = schedule(3, 12, 2);
        let mut plan = s.plan().unwrap();
        let at = plan.steps[1]
            .iter()
            .position(|st| matches!(st, crate::plan::Step::Notify { .. }))
            .unwrap();
        plan.steps[1].remove(at);
        assert!(crate::check(plan).is_err());
        let mut plan = s.plan().unwrap();
        plan.steps[0].retain(|st| !matches!(st, crate::plan::Step::Wait { .. }));
        assert!(crate::check(plan).is_err());
        // without the waits for the dones a rank's next call may overwrite rows a peer still
        // reads
        let mut plan = s.plan().unwrap();
        let done_row = 1;
        for steps in plan.steps.iter_mut() {
            steps.retain(
                |st| !matches!(st, crate::plan::Step::Wait { slot, .. } if slot.row == done_row),
            );
        }
        assert!(crate::check(plan).is_err());
        assert!(schedule(3, 13, 2).plan().is_err());
    }

    #[test]
    fn flags_do_not_overlap() {
        let s = schedule(4, 50, 3);
        let mut all: Vec<usize> = (0..4)
            .flat_map(|o| (0..MAX_PIECES).map(move |j| (o, j)))
            .map(|(o, j)| s.flag_index(o, j))
            .chain((0..4).map(|q| s.done_index(q)))
            .collect();
        let count = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), count);
        assert!(all.iter().all(|&f| f < s.flag_words()));
    }
}
