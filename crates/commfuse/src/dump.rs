//! `run --dump DIR`: every rank's input and output as .npy files that numpy (or any reader of
//! the format) opens. bf16 has no numpy dtype, so it is widened to float32, which is exact.

use anyhow::{Context, Result};
use commfuse_core::backend::{HostSlice, PreparedCall};
use npyz::WriterBuilder;
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

fn write_npy(path: &Path, data: HostSlice<'_>) -> Result<()> {
    match data {
        HostSlice::F32(s) => write_values(path, s.iter().copied()),
        HostSlice::BF16(s) => write_values(path, s.iter().map(|x| x.to_f32())),
        HostSlice::F16(s) => write_values(path, s.iter().copied()),
    }
}

fn write_values<T: npyz::AutoSerialize>(
    path: &Path,
    values: impl ExactSizeIterator<Item = T>,
) -> Result<()> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&[values.len() as u64])
        .writer(BufWriter::new(file))
        .begin_nd()?;
    w.extend(values)?;
    w.finish()?;
    Ok(())
}

fn cut(s: HostSlice<'_>, n: usize) -> HostSlice<'_> {
    match s {
        HostSlice::F32(x) => HostSlice::F32(&x[..n]),
        HostSlice::BF16(x) => HostSlice::BF16(&x[..n]),
        HostSlice::F16(x) => HostSlice::F16(&x[..n]),
    }
}

/// Writes `rank{r}_input.npy` and `rank{r}_output.npy` for every rank, each cut to the length
/// the op defines for that rank.
pub fn dump(dir: &Path, call: &dyn PreparedCall, spec: &commfuse_core::OpSpec) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for r in 0..spec.world {
        write_npy(
            &dir.join(format!("rank{r}_input.npy")),
            cut(call.input(r), spec.input_len(r)),
        )?;
        write_npy(
            &dir.join(format!("rank{r}_output.npy")),
            cut(call.output(r), spec.output_len(r)),
        )?;
    }
    Ok(())
}
