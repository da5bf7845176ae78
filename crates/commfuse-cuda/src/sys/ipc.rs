//! Groups across processes (one process per GPU, PyTorch's model): what a rank exports of its
//! operator's buffers for the other processes to open, as bytes any rendezvous can carry
//! (`torch.distributed`'s `all_gather_object`, NCCL's bootstrap, a file). A rank's operator
//! exports the IPC handles of its buffers; every peer opens them into its own context
//! ([`crate::sys::driver::IpcMapping`]), so that its kernels and copies address them as its own
//! memory (a [`crate::gemm_rs::flag_step::PeerMemory`] of context 0).

use crate::error::CudaError;
use crate::sys::driver::IpcHandle;

/// The format's first byte.
const VERSION: u8 = 2;

/// The IPC handles of one rank's buffers, in the order its operator lists them, with the rank
/// and world they belong to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    /// What exported it (checked on import: a GEMM + reduce-scatter's handles are not an
    /// all-gather + GEMM's)
    pub operator: String,
    pub rank: usize,
    pub world: usize,
    pub handles: Vec<IpcHandle>,
    /// The operator's other shared bytes: what every rank must have built alike
    /// ([`agreement`]), after GEMM + reduce-scatter's rank 0 NCCL unique id for its unfused path
    pub extra: Vec<u8>,
}

/// What every rank of a group must have built alike, as the `name=value` lines an operator puts
/// in its export ([`Exported::extra`]); [`check_agreement`] compares them on connect.
pub fn agreement(fields: &[(&str, String)]) -> Vec<u8> {
    fields
        .iter()
        .map(|(name, value)| format!("{name}={value}\n"))
        .collect::<String>()
        .into_bytes()
}

/// Refuses a group whose ranks built `operator` differently: `mine` is this rank's
/// [`agreement`], `theirs(e)` the agreement in export `e`. The error names the first field that
/// differs and its value on both ranks, so that every rank ends in the same one-line diagnosis
/// instead of writing into buffers its peers sized for another shape.
pub fn check_agreement(
    operator: &str,
    rank: usize,
    mine: &[u8],
    exports: &[Exported],
    theirs: impl Fn(&Exported) -> &[u8],
) -> Result<(), CudaError> {
    let fields = |bytes: &[u8]| -> Vec<(String, String)> {
        String::from_utf8_lossy(bytes)
            .lines()
            .map(|l| match l.split_once('=') {
                Some((name, value)) => (name.to_string(), value.to_string()),
                None => (l.to_string(), String::new()),
            })
            .collect()
    };
    let ours = fields(mine);
    for e in exports {
        let other = fields(theirs(e));
        if other == ours {
            continue;
        }
        let differs = ours
            .iter()
            .zip(&other)
            .find(|(a, b)| a != b)
            .map(|((name, value), (their_name, their_value))| {
                if name == their_name {
                    format!(
                        "{name}={their_value} on rank {}, {name}={value} on rank {rank}",
                        e.rank
                    )
                } else {
                    format!(
                        "field {their_name} on rank {}, {name} on rank {rank}",
                        e.rank
                    )
                }
            })
            .unwrap_or_else(|| {
                format!(
                    "{} fields on rank {}, {} on rank {rank}",
                    other.len(),
                    e.rank,
                    ours.len()
                )
            });
        return Err(CudaError::Unavailable(format!(
            "{operator}: the ranks built it differently ({differs}): every rank of a group must build it alike"
        )));
    }
    Ok(())
}

impl Exported {
    /// As bytes: version, rank and world (u32 LE each), the operator's name (u16 LE length,
    /// UTF-8), the handle count (u16 LE), the handles (64 bytes each), the extra bytes (u16 LE
    /// length, then them).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        out.extend((self.rank as u32).to_le_bytes());
        out.extend((self.world as u32).to_le_bytes());
        out.extend((self.operator.len() as u16).to_le_bytes());
        out.extend(self.operator.as_bytes());
        out.extend((self.handles.len() as u16).to_le_bytes());
        for h in &self.handles {
            out.extend(h.0);
        }
        out.extend((self.extra.len() as u16).to_le_bytes());
        out.extend(&self.extra);
        out
    }

    /// Reads [`Exported::to_bytes`]'s bytes; anything else is a one-line error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Exported, CudaError> {
        let bad = |what: &str| {
            CudaError::Unavailable(format!(
                "not an exported commfuse operator ({what}, {} bytes)",
                bytes.len()
            ))
        };
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8], CudaError> {
            let end = at
                .checked_add(n)
                .filter(|&e| e <= bytes.len())
                .ok_or_else(|| bad("too short"))?;
            let piece = &bytes[at..end];
            at = end;
            Ok(piece)
        };
        if take(1)?[0] != VERSION {
            return Err(bad("unknown version"));
        }
        let u32_at = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize;
        let u16_at = |b: &[u8]| u16::from_le_bytes(b.try_into().expect("2 bytes")) as usize;
        let rank = u32_at(take(4)?);
        let world = u32_at(take(4)?);
        let name_len = u16_at(take(2)?);
        let operator = String::from_utf8(take(name_len)?.to_vec()).map_err(|_| bad("name"))?;
        let count = u16_at(take(2)?);
        let mut handles = Vec::with_capacity(count);
        for _ in 0..count {
            handles.push(IpcHandle(take(64)?.try_into().expect("64 bytes")));
        }
        let extra_len = u16_at(take(2)?);
        let extra = take(extra_len)?.to_vec();
        if at != bytes.len() {
            return Err(bad("trailing bytes"));
        }
        if rank >= world {
            return Err(bad("rank outside its world"));
        }
        Ok(Exported {
            operator,
            rank,
            world,
            handles,
            extra,
        })
    }

    /// Every rank's export from this rank's, through the caller's own all-gather of bytes
    /// (`all_gather` gets this rank's bytes and returns every rank's, in rank order: MPI's
    /// `Allgather`, a key-value store, ...).
    pub fn exchange_with<E: std::fmt::Display>(
        &self,
        all_gather: impl FnOnce(Vec<u8>) -> Result<Vec<Vec<u8>>, E>,
    ) -> Result<Vec<Exported>, CudaError> {
        let all = all_gather(self.to_bytes())
            .map_err(|e| CudaError::Unavailable(format!("exchanging exports: {e}")))?;
        all.iter().map(|b| Exported::from_bytes(b)).collect()
    }

    /// Every rank's export from this rank's, through files in `dir` (a directory every rank
    /// sees, different for each group and operator): this rank writes `{dir}/{rank}` (atomically,
    /// by rename) and reads the others' as they appear, waiting at most `timeout` in all.
    pub fn exchange_through_dir(
        &self,
        dir: &std::path::Path,
        timeout: std::time::Duration,
    ) -> Result<Vec<Exported>, CudaError> {
        let io = |what: &str, e: std::io::Error| {
            CudaError::Unavailable(format!(
                "exchanging exports in {}: {what}: {e}",
                dir.display()
            ))
        };
        let tmp = dir.join(format!("{}.tmp", self.rank));
        std::fs::write(&tmp, self.to_bytes()).map_err(|e| io("write", e))?;
        std::fs::rename(&tmp, dir.join(self.rank.to_string())).map_err(|e| io("rename", e))?;
        let deadline = std::time::Instant::now() + timeout;
        (0..self.world)
            .map(|r| loop {
                if let Ok(bytes) = std::fs::read(dir.join(r.to_string())) {
                    break Exported::from_bytes(&bytes);
                }
                if std::time::Instant::now() >= deadline {
                    break Err(CudaError::Stalled(format!(
                        "rank {} waited {timeout:?} for rank {r}'s export in {}",
                        self.rank,
                        dir.display()
                    )));
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            })
            .collect()
    }

    /// Every rank's export, checked to be of `operator`, of `world` ranks, in rank order, each
    /// with `handles` handles.
    pub fn check_group(
        exports: &[Exported],
        operator: &str,
        world: usize,
        handles: usize,
    ) -> Result<(), CudaError> {
        if exports.len() != world {
            return Err(CudaError::Unavailable(format!(
                "{operator}: {} exports for a group of {world}",
                exports.len()
            )));
        }
        for (q, e) in exports.iter().enumerate() {
            if e.operator != operator
                || e.rank != q
                || e.world != world
                || e.handles.len() != handles
            {
                return Err(CudaError::Unavailable(format!(
                    "{operator}: export {q} is {}'s of rank {} of {} with {} handles, expected rank {q} of {world} with {handles}",
                    e.operator,
                    e.rank,
                    e.world,
                    e.handles.len()
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_travel_through_a_directory_and_a_closure() {
        let dir = tempfile::tempdir().unwrap();
        let all: Vec<Vec<Exported>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let d = dir.path();
                    s.spawn(move || {
                        sample(r)
                            .exchange_through_dir(d, std::time::Duration::from_secs(10))
                            .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(all[0], vec![sample(0), sample(1)]);
        assert_eq!(all[0], all[1]);
        // a rank that never writes: a bounded wait naming it
        let lone = tempfile::tempdir().unwrap();
        let e = sample(0)
            .exchange_through_dir(lone.path(), std::time::Duration::from_millis(50))
            .unwrap_err();
        assert!(e.to_string().contains("for rank 1's export"), "{e}");
        let got = sample(1)
            .exchange_with(|mine| Ok::<_, String>(vec![sample(0).to_bytes(), mine]))
            .unwrap();
        assert_eq!(got, vec![sample(0), sample(1)]);
        let e = sample(0).exchange_with(|_| Err("store down")).unwrap_err();
        assert!(e.to_string().contains("store down"));
    }

    #[test]
    fn ranks_built_alike_agree_and_a_difference_names_the_field_and_both_values() {
        let built = |n: usize| agreement(&[("max_m", "64".into()), ("n", n.to_string())]);
        let exports: Vec<Exported> = [4096, 4096, 8192]
            .iter()
            .enumerate()
            .map(|(r, &n)| Exported {
                extra: built(n),
                ..sample(r)
            })
            .collect();
        fn theirs(e: &Exported) -> &[u8] {
            &e.extra
        }
        assert!(check_agreement("gemm-rs", 0, &built(4096), &exports[..2], theirs).is_ok());
        let err = check_agreement("gemm-rs", 0, &built(4096), &exports, theirs)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("n=8192 on rank 2, n=4096 on rank 0") && err.contains("gemm-rs"),
            "{err}"
        );
        assert!(!err.contains('\n'), "one line: {err}");
        // a field the other rank does not have
        let short = agreement(&[("max_m", "64".into())]);
        let err = check_agreement("ag-gemm", 1, &short, &exports[..1], theirs)
            .unwrap_err()
            .to_string();
        assert!(err.contains("2 fields on rank 0, 1 on rank 1"), "{err}");
    }

    fn sample(rank: usize) -> Exported {
        Exported {
            operator: "gemm-rs".into(),
            rank,
            world: 2,
            handles: vec![IpcHandle([rank as u8; 64]), IpcHandle([7; 64])],
            extra: vec![rank as u8; 3],
        }
    }

    #[test]
    fn bytes_round_trip_and_bad_bytes_are_refused_in_one_line() {
        let e = sample(1);
        let bytes = e.to_bytes();
        assert_eq!(Exported::from_bytes(&bytes).unwrap(), e);
        for broken in [
            &bytes[..bytes.len() - 1],
            &[bytes.as_slice(), &[0]].concat()[..],
            &[&[9u8][..], &bytes[1..]].concat()[..],
            &[][..],
        ] {
            let err = Exported::from_bytes(broken).unwrap_err().to_string();
            assert!(
                err.contains("not an exported commfuse operator") && !err.contains('\n'),
                "{err}"
            );
        }
        let mut outside = sample(1);
        outside.rank = 2;
        assert!(Exported::from_bytes(&outside.to_bytes()).is_err());
    }

    #[test]
    fn a_group_must_be_complete_in_order_and_of_one_operator() {
        let group = [sample(0), sample(1)];
        Exported::check_group(&group, "gemm-rs", 2, 2).unwrap();
        assert!(Exported::check_group(&group[..1], "gemm-rs", 2, 2).is_err());
        assert!(Exported::check_group(&[sample(1), sample(0)], "gemm-rs", 2, 2).is_err());
        assert!(Exported::check_group(&group, "ag-gemm", 2, 2).is_err());
        let e = Exported::check_group(&group, "gemm-rs", 2, 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected rank 0 of 2 with 4"), "{e}");
    }
}
